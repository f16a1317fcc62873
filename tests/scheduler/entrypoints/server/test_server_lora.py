"""LoRA adapters over HTTP, through the official openai client: a request's model names its adapter, /v1/models
lists adapters under the base model, unknown names are 404, and runtime load/unload (behind its flag)."""

from __future__ import annotations

import dataclasses

import openai
import pytest
from lora_helpers import merged, write_adapter
from sched_helpers import greedy_reference
from server_helpers import ENGINE, serving, wait_idle

from scheduler import LoRAConfig
from scheduler.entrypoints.cli import serve_args, server_config
from scheduler.entrypoints.server.config import LoRAModule, ServerConfig

NEW = 6
LORA_ENGINE = dataclasses.replace(ENGINE, lora_config=LoRAConfig(max_loras=2, max_lora_rank=8))


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def paths(hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-adapters")
    return {n: write_adapter(root / n, hf, seed=20 + i) for i, n in enumerate(("sql", "poem", "late"))}


@pytest.fixture(scope="module")
def served_lora(tiny_model_dir, paths):
    modules = (LoRAModule(name="sql", path=paths["sql"]),
               LoRAModule(name="poem", path=paths["poem"], base_model_name="tiny-base"))  # fmt: skip
    config = ServerConfig(lora_modules=modules, allow_runtime_lora_updating=True)
    with serving(tiny_model_dir, config, engine=LORA_ENGINE) as s:
        yield s


@pytest.fixture
def lora_client(served_lora):
    with openai.OpenAI(base_url=served_lora.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _complete(client, model: str) -> str:
    out = client.completions.create(model=model, prompt="hello world", max_tokens=NEW, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    return out.choices[0].text


def _oracle(served, hf, path: str | None) -> str:
    tok = served.llm.tokenizer
    ids = tok.encode("hello world", add_special_tokens=False)
    return tok.decode(greedy_reference(merged(hf, path) if path else hf, [ids], NEW)[0], skip_special_tokens=True)


def test_a_request_naming_an_adapter_runs_through_it(served_lora, lora_client, hf, paths):
    base = _complete(lora_client, served_lora.model)
    sql, poem = _complete(lora_client, "sql"), _complete(lora_client, "poem")
    assert base == _oracle(served_lora, hf, None)
    assert sql == _oracle(served_lora, hf, paths["sql"]) and poem == _oracle(served_lora, hf, paths["poem"])
    assert len({base, sql, poem}) == 3


def test_models_lists_the_adapters_under_the_base_model(served_lora, lora_client, paths):
    cards = {m.id: m for m in lora_client.models.list().data}
    assert list(cards) == [served_lora.model, "sql", "poem"]
    assert cards[served_lora.model].parent is None
    assert (cards["sql"].parent, cards["sql"].root) == (served_lora.model, paths["sql"])
    assert cards["poem"].parent == "tiny-base"
    assert lora_client.models.retrieve("sql").id == "sql"


def test_an_unknown_adapter_is_a_404_naming_the_model(lora_client):
    with pytest.raises(openai.NotFoundError) as e:
        _complete(lora_client, "nope")
    assert e.value.body["param"] == "model" and "sql" in e.value.body["message"]


def test_runtime_load_and_unload(served_lora, lora_client, hf, paths, tmp_path):
    post = served_lora.post
    r = post("load_lora_adapter", {"lora_name": "late", "lora_path": paths["late"]})
    assert r.status_code == 200 and "late" in r.text
    assert _complete(lora_client, "late") == _oracle(served_lora, hf, paths["late"])
    again = post("load_lora_adapter", {"lora_name": "late", "lora_path": paths["late"]})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    bad = post("load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert post("unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert post("unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        _complete(lora_client, "late")
    assert [m.id for m in lora_client.models.list().data] == [served_lora.model, "sql", "poem"]


def test_runtime_updating_is_off_by_default(served, client):
    assert served.post("load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}).status_code == 404


def test_cli_lora_flags_reach_the_configs(capsys):
    args = serve_args(["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
                       "--lora-modules", "a=/p", '{"name": "b", "path": "/q", "base_model_name": "m"}'])  # fmt: skip
    from scheduler.entrypoints.main_job import engine_config

    assert engine_config(args).lora_config == LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=3)
    assert server_config(args).lora_modules == (LoRAModule(name="a", path="/p"),
                                                LoRAModule(name="b", path="/q", base_model_name="m"))  # fmt: skip
    for argv, flag in ((["--lora-modules", "a=/p"], "--lora-modules"), (["--max-loras", "2"], "--max-loras"),
                       (["--enable-lora", "--lora-modules", "nopath"], "lora_modules")):  # fmt: skip
        with pytest.raises(SystemExit):
            serve_args(argv)
        assert flag in capsys.readouterr().err


def test_metrics_show_the_lora_requests_info_gauge(served_lora, lora_client, served):
    import httpx

    _complete(lora_client, "sql")
    text = httpx.get(served_lora.url + "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line and 'waiting_lora_adapters=""' in line
    assert "vllm:lora_requests_info" not in httpx.get(served.url + "/metrics").text  # LoRA off: no gauge


def test_lora_info_names_the_adapters_of_waiting_and_running_requests(tiny_hf, tmp_path):
    from sched_helpers import make_engine

    from scheduler import LoRARequest, SamplingParams
    from scheduler.entrypoints.server.metrics import LoRAInfo

    engine = make_engine(tiny_hf, lora=LoRAConfig(max_loras=1, max_lora_rank=8))
    a, b = (LoRARequest(name=n, path=write_adapter(tmp_path / n, tiny_hf, seed=i)) for i, n in enumerate("ab"))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("1", [1, 2, 3], params, lora_request=a)
    engine.add_request("2", [1, 2, 3], params, lora_request=b)
    engine.add_request("3", [1, 2, 3], params)
    assert (LoRAInfo.of(engine).waiting, LoRAInfo.of(engine).running) == ("a,b", "")
    engine.step()  # max_loras=1: b waits while a runs
    assert (LoRAInfo.of(engine).waiting, LoRAInfo.of(engine).running, LoRAInfo.of(engine).max_lora) == ("b", "a", 1)
    assert LoRAInfo.of(make_engine(tiny_hf)) is None


def test_the_early_fit_check_counts_pins_apart_with_the_adapter_salt(tiny_hf, tmp_path):
    """AsyncEngine.check refuses as the engine does: a prompt through an adapter shares no base-model pin, so all
    the pinned blocks count against it (the plain salt counted them shared and let it through)."""
    from sched_helpers import make_engine

    from paged_kv.errors import InvalidArgumentError
    from scheduler import LoRARequest, SamplingParams
    from scheduler.entrypoints.server.async_engine import AsyncEngine

    engine = make_engine(tiny_hf, num_blocks=48, lora=LoRAConfig(max_loras=1, max_lora_rank=8))
    system = list(range(10, 30))  # 5 blocks of 4, pinned
    engine.pin_prefix(system)
    while engine.has_unfinished_requests():
        engine.step()
    served = AsyncEngine(engine, tokenizer=None)
    read = engine.runner.loras.read(LoRARequest(name="a", path=write_adapter(tmp_path / "a", tiny_hf, seed=5)))
    pool = engine.block_manager.config
    prompt = system + [7, 8]
    room = (pool.num_blocks - pool.watermark_blocks - 2) * pool.block_size  # 2 blocks short of the pool
    params = SamplingParams(max_tokens=room - len(prompt), ignore_eos=True)
    assert served.pinned_apart(prompt, None) == 0 and served.pinned_apart(prompt, None, read) == 5
    served.check(prompt, params)  # base: the pins are shared
    key = engine.stage_loras([read.request])[0][0]
    with pytest.raises(InvalidArgumentError, match="5 held by pinned prefixes"):
        engine.check_request("x", prompt, params, lora=key)  # the engine refuses it through the adapter ...
    with pytest.raises(InvalidArgumentError, match="5 held by pinned prefixes"):
        served.check(prompt, params, read)  # ... and so does the early check


def test_a_slow_adapter_read_does_not_stall_the_running_requests(served_lora, lora_client, hf, paths, monkeypatch):
    """While a request's adapter files are being read (patched to block until released), the engine keeps stepping
    a running request; then the request through the adapter is served through it."""
    import threading

    import scheduler.runner.lora_manager as manager

    engine = served_lora.llm.engine
    wait_idle(served_lora)
    engine.runner.loras.unload("sql")  # dropped from host memory (engine idle): its next request reads it again
    reading, release, released = threading.Event(), threading.Event(), []
    real = manager.load_adapter

    def slow_read(*args, **kw):
        reading.set()
        released.append(release.wait(20))  # False: nobody released it (the engine thread itself was blocked)
        return real(*args, **kw)

    monkeypatch.setattr(manager, "load_adapter", slow_read)
    stepped = threading.Event()
    monkeypatch.setattr(served_lora.engine.processor, "step", _counting(served_lora.engine.processor.step, reading,
                                                                         stepped))  # fmt: skip
    stream = lora_client.completions.create(model=served_lora.model, prompt="hello", max_tokens=480, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))  # the running request has started
    sql = []
    client = threading.Thread(target=lambda: sql.append(_complete(lora_client, "sql")))
    client.start()
    try:
        assert reading.wait(20), "the adapter was not read again"
        assert stepped.wait(15), "the engine did not step while the adapter was read"
    finally:
        release.set()
        client.join(60)
        stream.close()
    assert released == [True]
    assert sql == [_oracle(served_lora, hf, paths["sql"])]


def _counting(step, reading, stepped, steps: int = 3):
    """``step`` that sets ``stepped`` once ``steps`` steps have run since ``reading`` was set."""
    count = []

    def counted():
        out = step()
        if reading.is_set():
            count.append(1)
            if len(count) >= steps:
                stepped.set()
        return out

    return counted
