"""The PyTorch decoder that stands in for vLLM: KV-cache decoding, the decode loop, the chat server."""

import json
import threading
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer

import pytest
import torch

from fusionrag.loadtests.checks import read_chat_stream
from fusionrag.loadtests.chat_server import ChatModel, chat_load, make_handler
from fusionrag.loadtests.decode_loop import decode_loop, rate_between
from fusionrag.loadtests.decoder import PRESETS, DecoderConfig, KVCache, generate, make_model
from fusionrag.retriever.errors import ConfigError

CFG = DecoderConfig(vocab=300, dim=32, layers=2, heads=4, ffn=64, max_seq=64)


@pytest.fixture(autouse=True)
def one_thread():
    # The machine is small and shared: one intra-op thread, as the CLI uses.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_kv_cache_decoding_matches_a_full_forward_pass():
    model = make_model(CFG)
    tokens = torch.randint(0, CFG.vocab, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(tokens, KVCache(CFG, 3, "cpu", torch.float32), 0)
        cache = KVCache(CFG, 3, "cpu", torch.float32)
        steps = [model(tokens[:, :7], cache, 0)] + [model(tokens[:, i:i + 1], cache, i) for i in range(7, 24)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        last = model(tokens, KVCache(CFG, 3, "cpu", torch.float32), 0, last_only=True)
    torch.testing.assert_close(last[:, 0], full[:, -1])
    # Causal: changing a later token leaves earlier logits alone.
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % CFG.vocab
    with torch.inference_mode():
        other = model(changed, KVCache(CFG, 3, "cpu", torch.float32), 0)
    torch.testing.assert_close(other[:, :20], full[:, :20])
    assert not torch.allclose(other[:, 20:], full[:, 20:])
    with pytest.raises(ConfigError, match="exceeds max_seq 64"):
        model(tokens, cache, 50)


def test_generate_is_greedy_and_stops_at_the_context_end():
    model = make_model(CFG)
    prompt = torch.randint(0, CFG.vocab, (2, 60), generator=torch.Generator().manual_seed(1))
    out = list(generate(model, KVCache(CFG, 2, "cpu", torch.float32), prompt, 100))
    assert len(out) == 5  # positions 60..63 get computed, plus the token predicted after the last
    with torch.inference_mode():
        first = model(prompt, KVCache(CFG, 2, "cpu", torch.float32), 0)[:, -1].argmax(-1)
    assert torch.equal(out[0], first)


def test_the_1b_preset_has_about_a_billion_parameters():
    assert 0.9e9 < PRESETS["1b"].parameters() < 1.2e9
    assert sum(p.numel() for p in make_model(CFG).parameters()) == CFG.parameters()


def test_decode_loop_reports_tokens_over_time():
    started = []
    r = decode_loop(CFG, "cpu", batch=2, prompt_len=8, seconds=1.0, on_start=lambda: started.append(1))
    assert started == [1] and not r["oom"] and r["tokens"] > 0 and r["tokens"] % 2 == 0
    times = [t for t, _ in r["timeline"]]
    counts = [n for _, n in r["timeline"]]
    assert times == sorted(times) and counts == sorted(counts) and counts[-1] == r["tokens"]
    assert rate_between(r["timeline"], times[0], times[-1]) == pytest.approx(
        (counts[-1] - counts[0]) / (times[-1] - times[0]))
    with pytest.raises(ConfigError, match="must cover the measured window"):
        rate_between(r["timeline"], times[-1] + 1, times[-1] + 2)
    with pytest.raises(ConfigError, match="prompt_len must be in"):
        decode_loop(CFG, "cpu", 1, 64, 1.0)


@pytest.fixture
def chat_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(ChatModel(CFG, name="tiny-test")))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _post(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=30)


def test_chat_server_streams_and_answers_like_openai(chat_server):
    with urllib.request.urlopen(chat_server + "/v1/models") as r:
        assert json.load(r)["data"][0]["id"] == "tiny-test"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x" * 500}]  # longer than fits
    with _post(chat_server, {"model": "tiny-test", "messages": msgs, "max_tokens": 7, "stream": True}) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        ans = read_chat_stream((line.strip() for line in r), 0.0, lambda: 0.5)
    assert ans.chunks == 7 and ans.finish_reason == "length" and len(ans.text.split()) == 7
    with _post(chat_server, {"messages": msgs[-1:], "max_tokens": 7}) as r:
        body = json.load(r)
    assert body["choices"][0]["message"]["content"] == ans.text  # greedy: same prompt end, same answer
    assert body["usage"] == {"prompt_tokens": CFG.max_seq - 7, "completion_tokens": 7, "total_tokens": CFG.max_seq}
    for bad, msg in (({"messages": []}, "non-empty list"), ({"max_tokens": 3}, "bad request"),
                     ({"messages": msgs, "max_tokens": 64}, "leaves no room")):
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(chat_server, bad)
        assert e.value.code == 400 and msg in json.load(e.value)["error"]["message"]


def test_chat_load_counts_streamed_tokens(chat_server):
    r = chat_load(chat_server, "tiny-test", concurrency=2, seconds=1.0, max_tokens=5)
    assert r["errors"] == 0 and r["tokens"] >= 5 and r["tokens"] % 5 == 0
    assert r["timeline"][-1][1] == r["tokens"] and r["tokens_per_s"] > 0
