"""The settings that change how a layer moves (kvpp_core/layer_settings.py): read as each rank acts on them, and a
launch whose ranks differ refused, naming the rank and its value."""

from __future__ import annotations

import pytest

from kvpp_core.config import KvppConfigError
from kvpp_core.layer_settings import read, refuse_differences

pytestmark = pytest.mark.unit


def test_each_rank_reads_its_settings_as_it_acts_on_them():
    assert read({}) == {"KVPP_BROADCAST_TRANSPORT": "auto", "KVPP_BROADCAST_WHOLE_CACHE": "0"}
    assert read({"KVPP_BROADCAST_TRANSPORT": " Collective ", "KVPP_BROADCAST_WHOLE_CACHE": "1"}) == {
        "KVPP_BROADCAST_TRANSPORT": "collective", "KVPP_BROADCAST_WHOLE_CACHE": "1"}
    # Unset and anything but 1 are the same choice, so the same value; a bad transport is compared as written.
    assert read({"KVPP_BROADCAST_WHOLE_CACHE": "0"}) == read({"KVPP_BROADCAST_WHOLE_CACHE": "yes"}) == read({})
    assert read({"KVPP_BROADCAST_TRANSPORT": "tcp"})["KVPP_BROADCAST_TRANSPORT"] == "tcp"


def test_ranks_that_agree_pass_and_each_setting_that_differs_names_the_first_rank_that_differs():
    same = read({"KVPP_BROADCAST_WHOLE_CACHE": "1"})
    refuse_differences({0: same, 1: same, 2: same})
    by_rank = {0: read({}), 1: read({}), 2: read({"KVPP_BROADCAST_WHOLE_CACHE": "1", "KVPP_BROADCAST_TRANSPORT": "shm"}),
               3: read({"KVPP_BROADCAST_TRANSPORT": "collective"})}
    with pytest.raises(KvppConfigError) as refused:
        refuse_differences(by_rank)
    transport, whole = str(refused.value).splitlines()
    assert transport.startswith("KVPP_BROADCAST_TRANSPORT is shm on rank 2 but auto on rank 0: it changes how a layer "
                                "moves")
    assert whole.startswith("KVPP_BROADCAST_WHOLE_CACHE is 1 on rank 2 but 0 on rank 0")
    assert whole.endswith("set KVPP_BROADCAST_WHOLE_CACHE alike in the environment of every rank (every node), or on "
                          "none")
