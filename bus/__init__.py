"""The bus: sockets, codec, the component runtime, the supervisor and callers' identity.

Every Weir process imports this package first (a component runs as ``python -m weir.launch``,
the supervisor through ``bus.supervisor``), so it imports structlog here, without rich.
structlog's console renderer uses rich for tracebacks when it is installed (it is wherever
transformers is: typer needs it), and importing it pulls in pygments' lexer tables: 0.18 s
of CPU in each of the eight processes of every start, measured on a 2-core EPYC. Weir logs
render as JSON, which never touches rich; a later ``import rich`` works as usual.
"""
import sys


def _structlog_without_rich() -> None:
    if "structlog" in sys.modules:
        return
    hide = "rich" not in sys.modules
    if hide:
        sys.modules["rich"] = None          # type: ignore[assignment]  # ImportError inside
    try:
        import structlog  # noqa: F401 - its first import, made here without rich
    finally:
        if hide:
            del sys.modules["rich"]


_structlog_without_rich()
