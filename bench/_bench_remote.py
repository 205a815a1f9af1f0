"""The @remote function bench_session.py calls; imported by every benchmark task."""

from clusterwire import remote

ECHO = "bench.echo"


@remote(name=ECHO)
def echo(value):
    """Return the argument unchanged (a trivial remote call)."""
    return value
