"""clusterwire: TensorFlow's distributed runtime as a transport-agnostic, plugin-based library.

``import clusterwire`` loads no transport: the plugin manager finds one the
first time a protocol is asked for.
"""

from clusterwire import errors, terminal_text
from clusterwire._version import __version__ as __version__
from clusterwire.cluster_spec import ClusterSpec
from clusterwire.functions import remote
from clusterwire.plugins import ResolverSpec, TransportSpec, get_plugin_manager, hookimpl
from clusterwire.protos.cluster_pb2 import ClusterDef, JobDef
from clusterwire.protos.tensorflow_server_pb2 import ConfigProto, ServerDef, ServerOptions
from clusterwire.server import Server
from clusterwire.session import Session

# Warnings name peers' addresses and errors: escaped when nothing else is configured.
terminal_text.protect_last_resort()

__all__ = [
    "ClusterDef",
    "ClusterSpec",
    "ConfigProto",
    "JobDef",
    "ResolverSpec",
    "Server",
    "ServerDef",
    "ServerOptions",
    "Session",
    "TransportSpec",
    "errors",
    "get_plugin_manager",
    "hookimpl",
    "remote",
]
