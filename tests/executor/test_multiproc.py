"""`MultiprocExecutor`: real worker processes (spawned, gloo on 127.0.0.1) on a tiny fp32 Llama.

Until the layers shard themselves, every rank computes the whole model: TP = 2 must give exactly
the tokens of TP = 1 (and still will once they shard, on fp32 up to reduction order).
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest
import zmq

from pagellm import LLM, SamplingParams
from pagellm.engine.errors import EngineDeadError
from pagellm.executor.errors import ExecutorDeadError, WorkerError
from pagellm.executor.multiproc import MultiprocExecutor
from pagellm.scheduler.output import CachedRequestData, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26], [30, 31]]
ENGINE = {"max_model_len": 128, "kv_cache_memory": 8 << 20}


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _shutdown(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_models):
    return _tokens(LLM(tiny_models["llama3"], **ENGINE))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def tp2(tiny_models, request):
    llm = LLM(
        tiny_models["llama3"], tensor_parallel_size=2, async_scheduling=request.param, **ENGINE
    )
    yield llm
    _shutdown(llm)


def test_tp2_through_worker_processes_gives_the_tokens_of_one_worker(tp2, reference):
    executor = tp2.llm_engine.engine_core.executor
    assert isinstance(executor, MultiprocExecutor) and len(executor.procs) == 2
    assert _tokens(tp2) == reference


def test_collective_rpc_returns_each_ranks_result_in_rank_order(tp2):
    executor = tp2.llm_engine.engine_core.executor
    assert executor.collective_rpc("parallel_rank") == [0, 1]
    spec = executor.get_kv_cache_spec()
    assert spec == tp2.llm_engine.engine_core.executor.collective_rpc("get_kv_cache_spec")[1]
    with pytest.raises(TypeError, match="method name"):
        executor.collective_rpc(lambda worker: worker.parallel_rank())


def test_a_step_that_raises_in_the_workers_raises_in_the_engine_which_goes_on(tp2, reference):
    executor = tp2.llm_engine.engine_core.executor
    unknown = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["nobody"],
            resumed_from_preemption=[False],
            new_block_ids=[[]],
            num_computed_tokens=[3],
        ),
        num_scheduled_tokens={"nobody": 1},
        total_num_scheduled_tokens=1,
        preempted_req_ids=set(),
        finished_req_ids=set(),
    )
    with pytest.raises(WorkerError, match="rank 0"):
        executor.execute_model(unknown)
    with pytest.raises(WorkerError, match="no public method"):
        executor.collective_rpc("_update_states")
    assert _tokens(tp2) == reference


def test_multiproc_executor_with_one_rank_gives_the_tokens_of_the_uniproc_one(
    tiny_models, reference
):
    llm = LLM(tiny_models["llama3"], distributed_executor_backend="mp", **ENGINE)
    try:
        assert isinstance(llm.llm_engine.engine_core.executor, MultiprocExecutor)
        assert _tokens(llm) == reference
    finally:
        _shutdown(llm)


def test_killed_worker_fails_the_engine_naming_its_rank_and_no_process_is_left(tiny_models):
    llm = LLM(tiny_models["llama3"], tensor_parallel_size=2, **ENGINE)
    executor = llm.llm_engine.engine_core.executor
    pids = executor.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    executor.procs[1].join()  # the kill has landed before the engine's next call
    with pytest.raises(ExecutorDeadError, match=r"rank 1 .* exited with code -9"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    _shutdown(llm)
    assert all(proc.exitcode is not None for proc in executor.procs)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_death_seen_only_after_the_look_does_not_block_the_send(tmp_path):
    """A worker's death can land after `_broadcast` has looked (a ``Process.join`` returns early
    when the monitor thread's ``waitpid`` reaped the child first). The send to its socket, which
    then has no peer, must end in `ExecutorDeadError`, not block: here a real PUSH socket that no
    worker ever connects to, and a death that the second look finds."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(f"ipc://{tmp_path}/steps-1")
    executor = object.__new__(MultiprocExecutor)
    executor._dead = None
    looks: list[int] = []

    def death() -> ExecutorDeadError | None:
        looks.append(1)
        if len(looks) < 2:
            return None
        return ExecutorDeadError("Worker rank 1 (pid 0) exited with code -9")

    executor._death = death  # type: ignore[method-assign]
    try:
        with pytest.raises(ExecutorDeadError, match="rank 1"):
            executor._send(sock, b"step")
    finally:
        sock.close(linger=0)
    assert len(looks) == 2


def test_killed_worker_under_an_engine_process_fails_it_naming_the_rank(tiny_models, capfd):
    """The engine core in its own process (as under ``pagellm serve``): the executor's monitor
    sees the death between steps, and the engine process reports it (its log goes to the
    inherited stderr) and exits; the front end then refuses requests."""
    llm = LLM(tiny_models["llama3"], tensor_parallel_size=2, multiprocess_engine=True, **ENGINE)
    client = llm.llm_engine.core_client
    workers = [
        p
        for p in psutil.Process(client.proc.pid).children()
        if "spawn_main" in " ".join(p.cmdline())
    ]
    assert len(workers) == 2 and len(_tokens(llm)) == len(PROMPTS)
    os.kill(workers[1].pid, signal.SIGKILL)
    client.proc.join(60)  # a guard against a hang, not a timing check: it exits on its own
    assert client.proc.exitcode == 1
    assert "Worker rank 1" in capfd.readouterr().err
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    client.shutdown()
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
