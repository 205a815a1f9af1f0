"""``python -m clusterwire.metrics``: the README's table of every metric, from the catalog."""

from clusterwire.metrics.catalog import markdown_table

print(markdown_table())
