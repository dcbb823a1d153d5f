"""The visible-device variables of ROCm (``ROCR_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES``,
``CUDA_VISIBLE_DEVICES``): reconciliation, conflicts, and logical → visible → physical ids.

Pure functions of an environment mapping and the machine's GPU count: the counts stand in for
the AMD GPUs this machine does not have.
"""

from __future__ import annotations

import pytest
from pagellm_rocm.visible import (
    CUDA_VAR,
    HIP_VAR,
    ROCR_VAR,
    RocmVisibleDevicesError,
    physical_device_id,
    synced_variables,
    visible_device_id,
    visible_devices,
)


def physical(env: dict[str, str], num_physical: int) -> list[int | str]:
    return visible_devices(env, num_physical).physical


@pytest.mark.parametrize(
    "env",
    [{}, {HIP_VAR: ""}, {CUDA_VAR: " "}, {ROCR_VAR: ""}, {HIP_VAR: "", CUDA_VAR: "", ROCR_VAR: ""}],
    ids=["unset", "hip-empty", "cuda-blank", "rocr-empty", "all-empty"],
)
def test_unset_or_empty_variables_show_every_gpu(env):
    assert physical(env, 4) == [0, 1, 2, 3]
    assert synced_variables(env) == {}


@pytest.mark.parametrize("var", [HIP_VAR, CUDA_VAR])
def test_hip_or_cuda_list_maps_logical_to_physical(var):
    env = {var: "3, 1"}
    assert physical(env, 4) == [3, 1]
    assert [visible_device_id(i, env, 4) for i in range(2)] == [0, 1]
    assert [physical_device_id(i, env, 4) for i in range(2)] == [3, 1]


def test_hip_indexes_into_what_rocr_leaves_visible():
    env = {ROCR_VAR: "4,5,6,7", HIP_VAR: "2,0"}
    assert physical(env, 8) == [6, 4]
    assert physical_device_id(0, env, 8) == 6


def test_rocr_alone_selects_physical_devices_and_uuids():
    assert physical({ROCR_VAR: "GPU-4e1f0c2d7a9b3e51,2"}, 4) == ["GPU-4e1f0c2d7a9b3e51", 2]
    assert physical({ROCR_VAR: "2,-1,3"}, 4) == [2]


def test_ids_past_the_machines_gpus_end_the_list():
    assert physical({HIP_VAR: "0,5,1"}, 4) == [0]
    assert physical({ROCR_VAR: "1,9,2"}, 4) == [1]


def test_hip_and_cuda_that_agree_are_one_list():
    env = {HIP_VAR: "1,0", CUDA_VAR: " 1, 0 "}
    assert physical(env, 2) == [1, 0]
    assert synced_variables(env) == {}


def test_hip_and_cuda_that_disagree_are_an_error_naming_both():
    env = {HIP_VAR: "0", CUDA_VAR: "1"}
    for ask in (lambda: physical(env, 2), lambda: synced_variables(env)):
        with pytest.raises(RocmVisibleDevicesError) as err:
            ask()
        message = str(err.value)
        assert "HIP_VISIBLE_DEVICES='0'" in message and "CUDA_VISIBLE_DEVICES='1'" in message
        assert "Set only one of them" in message


def test_hip_index_past_rocrs_devices_is_an_error_naming_both():
    env = {ROCR_VAR: "4,5", CUDA_VAR: "0,2"}
    with pytest.raises(RocmVisibleDevicesError) as err:
        physical(env, 8)
    message = str(err.value)
    assert "CUDA_VISIBLE_DEVICES='0,2' selects device 2" in message
    assert "ROCR_VISIBLE_DEVICES='4,5' leaves only 2 device(s) visible" in message


@pytest.mark.parametrize(
    ("env", "synced"),
    [
        ({HIP_VAR: "2,3"}, {CUDA_VAR: "2,3"}),
        ({CUDA_VAR: "1"}, {HIP_VAR: "1"}),
        ({CUDA_VAR: "1", HIP_VAR: ""}, {HIP_VAR: "1"}),  # empty counts as unset
        ({ROCR_VAR: "0"}, {}),
    ],
)
def test_the_unset_one_of_hip_and_cuda_takes_the_others_value(env, synced):
    assert synced_variables(env) == synced
    assert physical({**env, **synced}, 4) == physical(env, 4)


@pytest.mark.parametrize(
    ("logical", "env", "num_physical", "message"),
    [
        (2, {HIP_VAR: "1,0"}, 2, r"AMD GPU 2 does not exist: 2 AMD GPU\(s\) are visible"),
        (4, {}, 4, r"none of HIP_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES set"),
        (-1, {ROCR_VAR: "3"}, 4, r"from 0 to 0"),
        (0, {HIP_VAR: "-1"}, 4, r"no AMD GPU is visible \(HIP_VISIBLE_DEVICES='-1'\)"),
    ],
    ids=["past-list", "past-all", "negative", "none-visible"],
)
def test_out_of_range_logical_id_is_a_clear_error(logical, env, num_physical, message):
    with pytest.raises(RocmVisibleDevicesError, match=message):
        physical_device_id(logical, env, num_physical)
