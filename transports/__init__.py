"""clusterwire's built-in transports, one module or package per protocol.

Each registers through the ``clusterwire`` entry-point group, exactly as a
third-party plugin does; the core never imports these modules by name.
"""
