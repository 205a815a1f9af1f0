"""The interleave function of the data-files benchmark (importable by worker processes, which
allow it through ``@data.function`` once they import this module)."""

from __future__ import annotations

from clusterwire import data


@data.function
def records_of(name):
    """A TFRecord file's records: ``interleave``'s map_func, as TF's ``TFRecordDataset``."""
    return data.TFRecordDataset(name)


@data.function
def gzip_records_of(name):
    """A GZIP-compressed TFRecord file's records (the ``--gzip`` rows of c)."""
    return data.TFRecordDataset(name, compression_type="GZIP")
