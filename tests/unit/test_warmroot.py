"""The warm-restore pieces that need no container: which pool a restore may take from, which profiles
may take one at all, and the root-swap helper refusing what is not a warm container's (the swap itself
is tested on real containers in tests/integration/test_fork_warm.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec

from bus.messages import LayerRef
from bus.profiles import builtin_profiles
from hostagent._profiles import compile_profile
from hostagent.backends.container.warmpool import Warm, WarmKey, WarmPool, rebinds, takes_restore
from hostagent.backends.container.warmroot import HELPER


def layer(n: int, role: str = "base") -> LayerRef:
    return LayerRef(role=role, digest=f"sha256:{n:064x}", kind="dir", path=f"/l/{n}")


def test_builtin_profiles_take_a_restore_and_the_image_dirs_are_bound_again() -> None:
    """Landlock is applied at the claim, in the new root; the read-only binds of the image's own dirs are
    made again there (those under /proc and /sys move with them); a masked path of the image is not.
    ``strict`` (guard kills) too: guard finds the sandbox through its record's container id."""
    built = {name: compile_profile(p) for name, p in builtin_profiles().items()}
    assert {name: takes_restore(e) for name, e in built.items()} == {"default": True, "strict": True, "build": True, "e2b": True}
    assert rebinds(built["default"]) == ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"]
    assert rebinds(built["e2b"]) == []
    masked = msgspec.structs.replace(builtin_profiles()["default"], fs=msgspec.structs.replace(
        builtin_profiles()["default"].fs, masked_paths=["/proc/kcore", "/opt/secret"]))
    assert not takes_restore(compile_profile(masked))
    for bad in (["/"], ["/.dsec/run"]):  # no writable paths, or a read-only / would cover them
        ro = msgspec.structs.replace(builtin_profiles()["build"], fs=msgspec.structs.replace(
            builtin_profiles()["build"].fs, readonly_paths=bad, writable=[], devices=[]))
        assert not takes_restore(compile_profile(ro)), bad


async def test_a_restore_takes_from_the_pool_of_its_template_only() -> None:
    e2b = compile_profile(builtin_profiles()["e2b"])
    build = compile_profile(builtin_profiles()["build"])
    pool = WarmPool(2, start=None, remove=None)  # type: ignore[arg-type]  # nothing is started or removed here
    template = WarmKey.of([layer(1), layer(2)], 1024, e2b)
    pool.entries()[template] = [Warm("wp-a", 1, "/s/a", None)]  # type: ignore[arg-type]
    snapshot = [layer(1), layer(2), layer(3, "fork")]
    assert pool.base_of(WarmKey.of(snapshot, 1024, e2b)) == template
    assert pool.base_of(WarmKey.of(snapshot, 2048, e2b)) is None  # another disk size
    assert pool.base_of(WarmKey.of(snapshot, 1024, build)) is None  # another profile
    assert pool.base_of(WarmKey.of([layer(9), layer(2), layer(3, "fork")], 1024, e2b)) is None  # another template
    assert pool.base_of(WarmKey.of([layer(1), layer(2)], 1024, e2b)) is None  # no snapshot layers: a plain create's pool
    pool.entries()[template].clear()
    assert pool.base_of(WarmKey.of(snapshot, 1024, e2b)) is None  # none waiting: the restore starts cold


def test_helper_refuses_what_is_not_a_warm_container_and_serves_on() -> None:
    p = subprocess.Popen([sys.executable, "-I", "-S", str(HELPER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        def ask(req: dict[str, object]) -> dict[str, object]:
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(json.dumps(req) + "\n")
            p.stdin.flush()
            out: dict[str, object] = json.loads(p.stdout.readline())
            return out

        base = {"pid": os.getpid(), "lowers": ["/l/1"], "upper": "/s/upper", "work": "/s/work"}
        assert ask({**base, "cgroup": "dsec/../../x"}) == {"ok": False, "error": "ValueError: bad cgroup 'dsec/../../x'"}
        assert ask({**base, "cgroup": "dsec/c", "lowers": ["/l/1,upperdir=/etc"]}) == {"ok": False, "error": "ValueError: bad overlay paths"}
        for bad in (["usr"], ["/usr/../proc"], ["/proc/sys"], ["/.dsec/run"], ["/"]):
            assert ask({**base, "cgroup": "dsec/c", "rebind": bad}) == {"ok": False, "error": "ValueError: bad read-only paths"}
        # not a container's cgroup
        out = ask({**base, "cgroup": "dsec/none-such-container"})
        assert out["ok"] is False and "FileNotFoundError" in str(out["error"])
    finally:
        assert p.stdin is not None
        p.stdin.close()
        assert p.wait(10) == 0  # it ended at the end of its input, not on one of the requests above
