"""The registry swaps whole sets of policies, never half of one, and keeps old versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.policy.errors import PolicySetError
from gateway.policy.registry import PolicyRegistry
from tests.policy.conftest import WriteFile

ECHO = "{name: echo, description: Echo., executor: {python: 'tests.policy.sample_tools:echo_sync'}}"


def test_load_serves_every_file(policy_dir: Path, write: WriteFile) -> None:
    write("a.yaml", "name: alpha\nlimits: {max_turns: 3}\n")
    write("b.yml", f"name: beta\ntools:\n  - {ECHO}\n")
    write("notes.txt", "not a policy")
    reg = PolicyRegistry(policy_dir)
    result = reg.load()
    assert result.ok and result.loaded == ("alpha", "beta") and result.changed == ("alpha", "beta")
    alpha = reg.get("alpha")
    assert alpha is not None and alpha.limits.max_turns == 3
    assert reg.version_of("alpha") == alpha.version and reg.get("gamma") is None
    assert "beta" in reg and reg.names() == ("alpha", "beta")


def test_a_bad_file_never_half_loads(policy_dir: Path, write: WriteFile) -> None:
    write("a.yaml", "name: alpha\nlimits: {max_turns: 3}\n")
    reg = PolicyRegistry(policy_dir)
    reg.load()
    before = reg.get("alpha")
    # alpha edited (valid) and a new file that is bad: neither may apply
    write("a.yaml", "name: alpha\nlimits: {max_turns: 9}\n")
    bad = write("z.yaml", "name: zeta\nlimits: {max_turns: many}\n")
    result = reg.reload()
    assert not result.ok and result.loaded == ("alpha",)
    assert len(result.errors) == 1 and result.errors[0].file == str(bad) and result.errors[0].line == 2
    assert reg.get("alpha") is before and reg.get("zeta") is None
    with pytest.raises(PolicySetError) as info:
        reg.load()
    assert str(bad) in str(info.value) and "no policy was changed" in str(info.value)
    # fixing the file applies both changes at once
    write("z.yaml", "name: zeta\nlimits: {max_turns: 2}\n")
    result = reg.reload()
    assert result.ok and result.changed == ("alpha", "zeta")
    assert reg.get("alpha").limits.max_turns == 9  # type: ignore[union-attr]


def test_errors_across_files(policy_dir: Path, write: WriteFile) -> None:
    write("a.yaml", "name: same\n")
    dup = write("b.yaml", "name: same\n")
    write("c.yaml", "name: parent\ntools:\n  - name: sub\n    description: S.\n    executor:\n"
          "      agent: {policy: missing}\n")
    result = PolicyRegistry(policy_dir).reload()
    messages = sorted(str(e) for e in result.errors)
    assert messages[0].startswith(f"{dup}:1: name: policy 'same' is already defined in")
    assert f"{policy_dir / 'c.yaml'}:6: tools[0].executor.agent.policy: no policy named 'missing'" in messages[1]


def test_reload_keeps_old_versions_for_running_runs(policy_dir: Path, write: WriteFile) -> None:
    write("a.yaml", "name: alpha\nlimits: {max_turns: 3}\n")
    reg = PolicyRegistry(policy_dir)
    reg.load()
    v1 = reg.version_of("alpha")
    assert v1 is not None
    write("a.yaml", "name: alpha\nlimits: {max_turns: 5}\n")
    result = reg.reload()
    v2 = reg.version_of("alpha")
    assert result.changed == ("alpha",) and v2 != v1
    old, new = reg.get_version("alpha", v1), reg.get("alpha")
    assert old is not None and new is not None
    assert old.limits.max_turns == 3 and new.limits.max_turns == 5
    assert reg.get_version("alpha", "000000000000") is None
    # an unchanged reload changes nothing; a removed file disappears from the current set only
    assert reg.reload().changed == ()
    (policy_dir / "a.yaml").unlink()
    assert reg.reload().changed == ("alpha",) and reg.get("alpha") is None
    assert reg.get_version("alpha", v2) is new  # type: ignore[arg-type]


def test_missing_directory_is_an_error(tmp_path: Path) -> None:
    result = PolicyRegistry(tmp_path / "nope").reload()
    assert not result.ok and "cannot list the policy directory" in str(result.errors[0])
