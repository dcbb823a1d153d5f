"""The engine-core process: its wire protocol (msgspec frames over IPC, never pickle), utility
calls, aborts, idling, the error report on an engine exception, and `LLM`'s multiprocess mode."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import tempfile
import time

import msgspec
import pytest
import zmq

from pagellm import LLM, SamplingParams
from pagellm.engine.args import EngineArgs
from pagellm.engine.core_client import SyncMPClient
from pagellm.engine.core_proc import run_engine_core
from pagellm.engine.errors import EngineDeadError
from pagellm.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineError,
    EngineReady,
    EngineStepOutputs,
    UtilityCall,
    UtilityResult,
    encoder,
    output_decoder,
)
from pagellm.request import EngineCoreRequest, FinishReason

PROMPTS = ["in the of and to", "is it that for the", "on with as at by and of", "a"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class RawClient:
    """The front end's side of the protocol, by hand: plain sockets, every frame checked."""

    def __init__(self, model: str) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="pagellm-test-")
        input_address = f"ipc://{self.tmpdir}/input"
        output_address = f"ipc://{self.tmpdir}/output"
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(input_address)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(output_address)
        config = EngineArgs(
            model, max_model_len=128, kv_cache_memory=8 << 20
        ).create_engine_config()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(config, input_address, output_address, os.getpid()),
            daemon=True,
        )
        self.proc.start()
        self.frames: list[bytes] = []

    def send(self, msg: msgspec.Struct) -> None:
        self.push.send(encoder.encode(msg))

    def recv(self, timeout_s: float = 60.0) -> msgspec.Struct:
        if not self.pull.poll(int(timeout_s * 1000)):
            raise TimeoutError("no message from the engine process")
        frame = self.pull.recv()
        self.frames.append(frame)
        return output_decoder.decode(frame)

    def call(self, call_id: int, method: str, *args: object) -> UtilityResult:
        self.send(UtilityCall(call_id, method, list(args)))
        while True:
            msg = self.recv()
            if isinstance(msg, UtilityResult):
                assert msg.call_id == call_id
                return msg

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_engine_process_speaks_msgspec_serves_utilities_and_reports_a_failure(tiny_models):
    client = RawClient(tiny_models["llama3"])
    try:
        ready = client.recv()
        assert isinstance(ready, EngineReady) and ready.num_blocks > 1
        num_usable = ready.num_blocks - 1  # the null block is never handed out

        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        client.send(AddRequest(EngineCoreRequest("r", [5, 6, 7], params, None, 0.0)))
        tokens: list[int] = []
        finish = None
        steps: list[EngineStepOutputs] = []
        while finish is None:
            msg = client.recv()
            assert isinstance(msg, EngineStepOutputs)
            steps.append(msg)
            for out in msg.outputs.outputs:
                tokens += out.new_token_ids
                finish = out.finish_reason
        assert len(tokens) == 4 and finish == FinishReason.LENGTH
        stats = [s.scheduler_stats for s in steps]
        assert [s.num_steps for s in stats] == list(range(1, len(steps) + 1))
        assert stats[0].num_running_reqs == 1 and stats[0].num_free_blocks < num_usable
        assert stats[-1].num_running_reqs == 0
        assert stats[-1].num_free_blocks == stats[-1].num_total_blocks == num_usable
        assert stats[0].prefix_cache_queries == 3

        assert client.call(1, "get_state").result["num_running"] == 0
        assert client.call(2, "reset_prefix_cache").result is True
        unknown = client.call(3, "shutdown_everything")
        assert unknown.result is None and "unknown utility" in (unknown.error or "")

        # An aborted request frees its blocks before the next message is handled.
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        client.send(AddRequest(EngineCoreRequest("long", [5, 6, 7], long, None, 0.0)))
        client.send(AbortRequests(["long"]))
        state = client.call(4, "get_state").result
        assert state["num_running"] == state["num_waiting"] == 0
        assert state["num_free_blocks"] == state["num_total_blocks"] == num_usable

        # Idle, the loop sleeps on its socket instead of spinning.
        while client.pull.poll(200):
            client.recv()
        before = _cpu_seconds(client.proc.pid)
        time.sleep(1.0)
        assert _cpu_seconds(client.proc.pid) - before < 0.3

        # Every frame is plain msgpack: a tagged array, no pickle.
        for frame in client.frames:
            assert frame[:1] != b"\x80"  # a pickle stream starts with its PROTO opcode
            raw = msgspec.msgpack.decode(frame)
            assert isinstance(raw, list) and raw[0] in {"ready", "outputs", "result", "error"}

        # A request the engine cannot add (a duplicate id) fails alone; the engine goes on.
        client.send(AddRequest(EngineCoreRequest("dup", [5, 6], long, None, 0.0)))
        client.send(AddRequest(EngineCoreRequest("dup", [5, 6], long, None, 0.0)))
        failed = None
        while failed is None:
            msg = client.recv()
            assert isinstance(msg, EngineStepOutputs)
            failed = next((o for o in msg.outputs.outputs if o.finish_reason is not None), None)
        assert failed.request_id == "dup" and failed.finish_reason == FinishReason.ERROR
        client.send(AbortRequests(["dup"]))
        assert client.call(5, "get_state").result["num_running"] == 0

        # An exception in the loop itself (a frame that is no message) is reported, then the
        # process exits 1.
        client.push.send(b"not a message")
        while not isinstance(msg := client.recv(), EngineError):
            pass
        assert "msgspec" in msg.traceback and "decode" in msg.traceback
        client.proc.join(10)
        assert client.proc.exitcode == 1
    finally:
        client.close()


def test_multiprocess_llm_matches_in_process_llm(tiny_models):
    model = tiny_models["llama3"]
    kwargs = dict(max_model_len=128, kv_cache_memory=8 << 20)
    params = [GREEDY, GREEDY, SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6), GREEDY]
    expected = LLM(model, **kwargs).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model, multiprocess_engine=True, **kwargs)
    engine = llm.llm_engine
    assert isinstance(engine.core_client, SyncMPClient)
    try:
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        for want, have in zip(expected, got, strict=True):
            assert [c.token_ids for c in have.outputs] == [c.token_ids for c in want.outputs]
            assert [c.text for c in have.outputs] == [c.text for c in want.outputs]
        assert engine.core_client.call_utility("get_state")["num_running"] == 0
        with pytest.raises(RuntimeError, match="another process"):
            _ = engine.engine_core
        with pytest.raises(ValueError):
            llm.generate([[5, 10**6]], GREEDY, use_tqdm=False)
        assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == (
            expected[0].outputs[0].token_ids
        )
    finally:
        engine.shutdown()
    client = engine.core_client
    # Stopped by its shutdown message (not terminated), and the IPC directory is gone.
    assert client.proc.exitcode == 0 and not os.path.exists(client.ipc_dir)


def test_killed_engine_process_fails_the_multiprocess_llm(tiny_models):
    llm = LLM(
        tiny_models["llama3"], multiprocess_engine=True, max_model_len=128, kv_cache_memory=8 << 20
    )
    engine = llm.llm_engine
    try:
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        engine.add_request("manual", PROMPTS[0], long)
        while not engine.step():
            pass
        proc = engine.core_client.proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        with pytest.raises(EngineDeadError, match="exit code -9"):
            engine.step()
        assert engine.core_client.errored
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        engine.shutdown()
    assert not os.path.exists(engine.core_client.ipc_dir)
