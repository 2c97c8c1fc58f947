"""Every SGLang name the hook patches or reads exists with the signature the hook relies on.

Checked against the installed SGLang (CI: 0.5.23) by import and ``inspect``, and — when an
unpacked source tree of another version is available (``SPECDEPTH_SGLANG_SRC=/path/to/sglang``,
e.g. the 0.5.17 wheel unzipped) — statically, by parsing that tree without importing it.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from sglang_hook import compat  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("target", compat.CONTRACT, ids=lambda t: t.path.removeprefix("sglang.srt."))
def test_installed_sglang_has_target(target: compat.Target) -> None:
    problem = compat.check_target(target)
    assert problem is None, problem


def test_installed_version_is_supported() -> None:
    assert compat.sglang_version() in compat.SUPPORTED_VERSIONS


def test_a_mismatch_names_the_target() -> None:
    bad = compat.Target(compat.PROCESS_BATCH_RESULT, ("self", "batch", "outcome"))
    problem = compat.check_target(bad)
    assert problem is not None and compat.PROCESS_BATCH_RESULT in problem
    missing = compat.Target("sglang.srt.managers.scheduler.Scheduler.no_such_method", ("self",))
    assert "no_such_method" in (compat.check_target(missing) or "")


def test_plugin_registers_exactly_the_contract_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_hook import plugin

    patched = {t.path for t in compat.CONTRACT if "patched" in t.why}
    assert {target for target, _ in plugin.HOOKS} == patched
    monkeypatch.setenv("SPECDEPTH_CONTROLLER", "ipc:///tmp/hook-contract.sock")
    saved = {k: list(v) for k, v in HookRegistry._hooks.items()}
    try:
        plugin.register()
        for target, fn in plugin.HOOKS:
            assert (HookType.AROUND, fn) in [(t, h) for t, h, _ in HookRegistry._hooks[target]]
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved)


def test_one_rank_launch_leaves_the_request_broadcast_unhooked(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_hook import plugin

    monkeypatch.setenv("SPECDEPTH_CONTROLLER", "ipc:///tmp/hook-contract.sock")
    monkeypatch.setenv("SPECDEPTH_SINGLE_RANK", "1")
    saved = {k: list(v) for k, v in HookRegistry._hooks.items()}
    try:
        plugin.register()
        ours = {target for target, hooks in HookRegistry._hooks.items() for _, h, _ in hooks if h in
                {fn for _, fn in plugin.HOOKS}}  # fmt: skip
        assert ours == {target for target, _ in plugin.HOOKS} - {compat.BROADCAST_REQS}
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved)


def test_plugin_registers_nothing_without_a_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_hook import plugin

    monkeypatch.delenv("SPECDEPTH_CONTROLLER", raising=False)
    before = {k: len(v) for k, v in HookRegistry._hooks.items()}
    plugin.register()
    assert {k: len(v) for k, v in HookRegistry._hooks.items() if v} == {k: n for k, n in before.items() if n}


# --------------------------------------------------------------------------- another version, statically


def _other_source() -> Path | None:
    root = os.environ.get("SPECDEPTH_SGLANG_SRC", "")
    return Path(root) if root and (Path(root) / "srt").is_dir() else None


def _static_check(root: Path, target: compat.Target) -> str | None:
    """Find ``target`` in an unpacked ``sglang`` source tree by parsing, never importing."""
    parts = target.path.split(".")
    assert parts[0] == "sglang"
    for split in range(len(parts) - 1, 0, -1):
        mod = root.joinpath(*parts[1:split])
        file = mod.with_suffix(".py") if mod.with_suffix(".py").is_file() else mod / "__init__.py"
        if file.is_file():
            break
    else:
        return f"{target.path}: module not found under {root}"
    node: ast.AST = ast.parse(file.read_text())
    for name in parts[split:]:
        body = getattr(node, "body", [])
        found = None
        for child in body:
            if (
                isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and child.name == name
            ):
                found = child
            elif (
                isinstance(child, ast.AnnAssign)
                and isinstance(child.target, ast.Name)
                and child.target.id == name
            ):
                found = child
            elif isinstance(child, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in child.targets
            ):  # an enum member, a class constant
                found = child
            elif isinstance(child, ast.ImportFrom) and any(
                (alias.asname or alias.name) == name for alias in child.names
            ):  # a name a module imports and later looks up by its own global
                found = child
        if found is None:
            return f"{target.path}: {name!r} not found in {file}"
        node = found
    if target.kind == "call" and target.params and isinstance(node, ast.FunctionDef):
        names = tuple(a.arg for a in node.args.posonlyargs + node.args.args)
        if names[: len(target.params)] != target.params:
            return f"{target.path}: expected parameters {target.params}, found {names}"
    return None


@pytest.mark.skipif(_other_source() is None, reason="set SPECDEPTH_SGLANG_SRC to an unpacked sglang tree")
@pytest.mark.parametrize("target", compat.CONTRACT, ids=lambda t: t.path.removeprefix("sglang.srt."))
def test_other_version_source_has_target(target: compat.Target) -> None:
    root = _other_source()
    assert root is not None
    problem = _static_check(root, target)
    assert problem is None, problem


def test_launcher_refuses_via_sglangs_own_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang alone would warn and drop adaptive mode; through the launcher it is a refusal."""
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.server_args import ServerArgs

    from sglang_hook import launch_server

    monkeypatch.setattr(speculative_hook, "_maybe_disable_adaptive", speculative_hook._maybe_disable_adaptive)
    launch_server._refuse_instead_of_disabling()

    def args(topk: int) -> ServerArgs:
        return ServerArgs(
            model_path="unused",
            speculative_algorithm="EAGLE",
            speculative_draft_model_path="unused",
            speculative_eagle_topk=topk,
            speculative_adaptive=True,
        )

    with pytest.raises(launch_server.Refused, match="topk"):
        speculative_hook._maybe_disable_adaptive(args(4))
    speculative_hook._maybe_disable_adaptive(args(1))  # supported: SGLang's own path, no refusal
