"""The ``kvkit`` command line.

Subcommands are looked up by name in :data:`COMMANDS` and imported only when
run, so ``kvkit --help`` and ``kvkit list`` stay fast and never pull in the
torch-heavy modules behind other commands. kvkit errors reach the user as one
line on stderr and exit code 2, never a traceback (:func:`kvkit_errors`); click's
own usage errors, which quote the arguments they refuse (an extra argument, an
unknown command: a store URL given without its flag), show them masked by
:mod:`kvkit.redact`'s rule, so no password is printed.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click
from typing_extensions import override

from kvkit.errors import ConfigError, KVKitError
from kvkit.redact import redact, redact_text

__all__ = ["COMMANDS", "KVKitUsageError", "check_plot_path", "kvkit_errors", "main", "shape_option"]

F = TypeVar("F", bound=Callable[..., Any])

COMMANDS: dict[str, str] = {
    "bench": "kvkit.cli.bench:bench_group",
    "list": "kvkit.cli.list:list_command",
    "policies": "kvkit.cli.policies:policies_command",
    "simulate": "kvkit.cli.simulate:simulate_command",
}
"""Subcommand name -> ``"module:attr"`` of its click command (imported on use)."""


class KVKitUsageError(click.ClickException):
    """A kvkit error shown as ``Error: <one line>`` on stderr, exit code 2."""

    exit_code = 2


def _one_line(exc: KVKitError) -> str:
    if isinstance(exc, ConfigError) and len(exc.problems) > 1:
        return f"{len(exc.problems)} configuration problems: " + "; ".join(exc.problems)
    return " ".join(str(exc).split())


@contextlib.contextmanager
def kvkit_errors(args: Sequence[str] = ()) -> Iterator[None]:
    """Turn a :class:`~kvkit.errors.KVKitError` raised inside into :class:`KVKitUsageError`, and mask the
    secrets in click's usage errors, which quote the arguments they refuse (:func:`_shown`; ``args``: the
    command line's): the error is masked in place and holds no cause or context (the errors click raised it
    from, such as a number's conversion, quote the argument too).

    ``main`` wraps every subcommand in it; use it directly only to run a
    command object outside ``main``.
    """
    try:
        yield
    except KVKitError as exc:
        raise KVKitUsageError(_one_line(exc)) from exc
    except click.UsageError as exc:  # masked in place: an error raised here would hold it unmasked as its context
        exc.message = _shown(exc.message, args)  # type: ignore[misc]  # click marks it Final; it only reads it
        exc.args = (exc.message,)
        exc.__cause__ = exc.__context__ = None  # the errors click raised it from quote the arguments too
        raise


def _shown(message: str, args: Sequence[str]) -> str:
    """click's ``message`` fit to show: each of the command line's ``args`` it quotes masked as a value
    (:func:`~kvkit.redact.redact`: a URL whole, a password holding a space included), then what is left as text
    (:func:`~kvkit.redact.redact_text`)."""
    for arg in sorted(args, key=len, reverse=True):
        if arg in message:
            message = message.replace(arg, str(redact(arg)))
    return redact_text(message)


def check_plot_path(path: Path | None) -> None:
    """Fail before any work if a ``--plot`` PNG could not be written at the end (``None``: no plot).

    Raises:
        click.UsageError: matplotlib is not installed.
        ConfigError: the PNG's folder does not exist or is not writable.
    """
    if path is None:
        return
    try:
        import matplotlib as mpl  # noqa: F401 - only whether it imports
    except ImportError:
        raise click.UsageError("--plot needs matplotlib: pip install 'kvkit[plot]'") from None
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"--plot {str(path)!r}: no folder {str(folder)!r}; create it or give another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--plot {str(path)!r}: the folder {str(folder)!r} is not writable")


def shape_option(help: str) -> Callable[[F], F]:
    """``--shape NAME[@FIELD=VALUE;...]``: a synthetic workload shape, as :func:`kvkit.shape` reads it.

    The value is checked while the options are parsed, so a bad name, field or
    value is a usage error quoting it before any work; the command gets the string.
    """
    from kvkit.sim.synthetic import SHAPES, shape  # the commands that take --shape import it anyway

    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is not None:
            try:
                shape(value)
            except ConfigError as exc:
                raise click.BadParameter(_one_line(exc), ctx, param) from None
        return value

    return click.option("--shape", "shape_name", default=None, metavar="NAME[@FIELD=VALUE;...]", callback=check,
                        help=f"{help} One of {', '.join(SHAPES)}; '@' moves fields of its generator, "
                             "as in few-shot@num_templates=1200;drift_every=400.")


def _first_doc_line(target: str) -> str:
    """First docstring line of ``target``'s function, read from source without importing it."""
    module, _, attr = target.partition(":")
    try:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            return ""
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    except (ImportError, AttributeError, TypeError, OSError, SyntaxError, ValueError):
        return ""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == attr:
            return (ast.get_docstring(node) or "").strip().partition("\n")[0]
    return ""


_ARGS = "kvkit.args"
"""Key of the context's ``meta`` holding the command line's arguments (for :func:`kvkit_errors`)."""


class _LazyGroup(click.Group):
    """A group whose subcommands come from :data:`COMMANDS`, imported on first use."""

    @override
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    @override
    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)

    @override
    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing help must not import the commands; read their docstrings instead.
        rows = [(name, _first_doc_line(COMMANDS[name])) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    @override
    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        given = [*args]  # not list(): importing the list command binds kvkit.cli.list
        with kvkit_errors(given):
            ctx = super().make_context(info_name, args, parent, **extra)
        ctx.meta[_ARGS] = given
        return ctx

    @override
    def invoke(self, ctx: click.Context) -> Any:
        with kvkit_errors(ctx.meta.get(_ARGS, ())):
            return super().invoke(ctx)


@click.group(cls=_LazyGroup)
@click.version_option(package_name="kvkit")
def main() -> None:
    """Compose, drive, explore and prove CPU offload tiers for paged KV caches."""
