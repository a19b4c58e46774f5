"""The KVCM-compatible server's state file when an admin request's one-go save lands while the
periodic saver's stepwise save is half way through its file (found by the chaos soak: the two
shared one temp file, the state file came out torn, and the next restart could not load it)."""

from __future__ import annotations

import json
from pathlib import Path

from sidecar.kvcm_server.state import SAVE_STEP, State


def _state(path: Path) -> State:
    st = State(lambda: 0.0, path)
    n = 3 * SAVE_STEP  # enough blocks for the stepwise save to yield twice mid-file
    st.load_blocks({"inst": [[str(k), [["ST_MEM", "GPU", "h:1", {"s": "v"}]]] for k in range(n)]})
    st.instances["inst"] = {"instance_id": "inst"}
    return st


def test_a_save_in_one_go_during_a_stepwise_save_leaves_a_whole_newest_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kvcm-state.json"
    st = _state(path)
    steps = st.save_steps()
    next(steps)  # the periodic saver, suspended half way through its file
    st.instances["new"] = {"instance_id": "new"}  # a registerInstance meanwhile ...
    st.save()  # ... saves at once
    for _ in steps:  # the older save finishes after the newer one landed
        pass
    data = json.loads(path.read_text())  # whole (it was torn)
    assert set(data["instances"]) == {"inst", "new"}  # the newer save's, not the older's
    assert len(data["blocks"]["inst"]) == 3 * SAVE_STEP
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind
    again = State(lambda: 0.0, path)  # a restart loads it
    assert set(again.instances) == {"inst", "new"}


def test_an_abandoned_stepwise_save_leaves_the_last_file_and_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "kvcm-state.json"
    st = _state(path)
    st.save()
    before = path.read_bytes()
    steps = st.save_steps()
    next(steps)
    steps.close()  # cancelled at shutdown
    assert path.read_bytes() == before and st.dirty
    assert list(tmp_path.iterdir()) == [path]
