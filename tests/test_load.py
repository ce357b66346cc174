import json
import re
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import huggingface_hub.constants
import pytest
import torch
from transformers import GPT2Config

from helpers import tiny_config, tiny_input_ids, tiny_model, tiny_tokenizer
from sparsify import load, locations
from sparsify.errors import ConfigError, DataError, SourceError, UnsupportedModelError
from sparsify.load import load_config, load_model, require_tokenizer
from sparsify.locations import demo_model_path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Qwen3 checkpoint folder with its tokenizer, and the logits of the model that wrote it."""
    folder = tmp_path_factory.mktemp("ckpt") / "qwen3"
    model, tokenizer = tiny_model("qwen3")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with torch.no_grad():
        return folder, model(tiny_input_ids()).logits


def _copy(saved, tmp_path, name="copy"):
    return shutil.copytree(saved[0], tmp_path / name)


def test_loads_a_folder_in_fp32_on_cpu(saved):
    folder, logits = saved
    model, tokenizer, spec = load_model(folder, device="cpu")
    assert spec.family == "qwen3" and not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert tokenizer("ab")["input_ids"] == tiny_model("qwen3")[1]("ab")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(tiny_input_ids()).logits, logits, rtol=0, atol=0)
    model, _, _ = load_model(str(folder), dtype="bf16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ConfigError, match="dtype"):
        load_model(folder, dtype="int3", device="cpu")


def test_unloaded_model_has_the_layout_without_reading_weights(saved, tmp_path):
    """weights=False (the other processes of an FSDP run): the same parameters, unread (no weight file is
    needed), each with storage of its own; buffers computed as a load computes them."""
    folder, _ = saved
    loaded, _, _ = load_model(folder, device="cpu")
    copy = _copy(saved, tmp_path)
    (copy / "model.safetensors").unlink()
    model, tokenizer, spec = load_model(copy, dtype=torch.float32, device="cpu", weights=False)
    assert spec.family == "qwen3" and tokenizer is not None and not model.training
    params = dict(model.named_parameters())
    assert {n: (p.shape, p.dtype, p.device.type) for n, p in params.items()} == \
        {n: (p.shape, p.dtype, "cpu") for n, p in loaded.named_parameters()}
    assert len({p.data_ptr() for p in params.values()}) == len(params)
    for (name, buffer), (_, expected) in zip(model.named_buffers(), loaded.named_buffers()):
        torch.testing.assert_close(buffer, expected, rtol=0, atol=0, msg=name)


def test_missing_tokenizer_is_none_until_needed(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    model, tokenizer, _ = load_model(folder, device="cpu")
    assert tokenizer is None
    with pytest.raises(SourceError, match="no tokenizer"):
        require_tokenizer(tokenizer, folder)


def test_a_tokenizer_beyond_the_embeddings_stops_before_a_forward():
    tokenizer = tiny_tokenizer()
    require_tokenizer(tokenizer, "m", tiny_config("llama"))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<extra>"]})  # added, not resized: no text holds it
    require_tokenizer(tokenizer, "m", tiny_config("llama"))
    with pytest.raises(SourceError, match="its vocabulary reaches id 258, and the model has 200 token embeddings"):
        require_tokenizer(tokenizer, "m", tiny_config("llama", vocab_size=200, bos_token_id=1, eos_token_id=2,
                                                     pad_token_id=3))


def _break_config(folder):
    (folder / "config.json").write_text("{not json")


def _unknown_model_type(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))


def _no_weights(folder):
    (folder / "model.safetensors").unlink()


def _truncate_weights(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


def _mismatched_shapes(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))


def _missing_tensor(folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "damage, message",
    [
        (_break_config, "cannot read its config.json"),
        (_unknown_model_type, "cannot read its config.json"),
        (_no_weights, "cannot load the weights"),
        (_truncate_weights, "cannot load the weights"),
        (_mismatched_shapes, "cannot load the weights"),
        (_missing_tensor, "do not match the config"),
    ],
)
def test_damaged_folders_raise_source_errors(saved, tmp_path, damage, message):
    folder = _copy(saved, tmp_path)
    damage(folder)
    with pytest.raises(SourceError, match=message):
        load_model(folder, device="cpu")


def test_a_cut_weight_file_is_named_from_its_header(saved, tmp_path):
    """A weight file cut short (a download or a copy) is named with how much of it is there, read from its header
    alone: the check the dry run makes too (tests/test_cli.py)."""
    folder = _copy(saved, tmp_path)
    size = (folder / "model.safetensors").stat().st_size
    _truncate_weights(folder)
    with pytest.raises(SourceError, match=re.escape(f"{folder}: cannot load the weights: model.safetensors: truncated "
                                                    f"({size // 2:,} of {size:,} bytes; download it again)")):
        load_model(folder, device="cpu")
    (folder / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")  # a Git LFS pointer
    with pytest.raises(SourceError, match="model.safetensors: no safetensors header"):
        load_model(folder, device="cpu")


def test_bad_paths(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(SourceError, match="not a folder"):
        load_model(tmp_path / "file.txt")
    with pytest.raises(SourceError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(SourceError, match="no such folder"):
        load_model("./does/not/exist")


def test_unsupported_architecture_fails_before_reading_weights(tmp_path):
    GPT2Config(n_layer=1).save_pretrained(tmp_path)  # a config and no weights at all
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(tmp_path)


def test_unknown_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SourceError, match=r"nobody-here/no-such-model: not a local folder, and offline \(HF_HUB_OFFLINE=1\) "
                                          r"the Hugging Face cache holds no copy of it: download it first \(`hf download "
                                          r"nobody-here/no-such-model --local-dir DIR`\)"):
        load_model("nobody-here/no-such-model")


class _NoSuchRepo(BaseHTTPRequestHandler):
    """The Hub's answer to a request for a repository that does not exist (or is private)."""

    def do_HEAD(self):
        self.server.requests.append(self.path)
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args):
        pass


def _of_repositories(requests: list[str]) -> list[str]:
    """The requests about repositories: huggingface_hub (2.4 on) may also fetch, once a day, the registry of coding
    agents that its user-agent header names."""
    return [path for path in requests if not path.startswith("/api/agent-harnesses")]


def _online_at_a_closed_port(monkeypatch) -> None:
    """_online_at a port nobody listens on: a request's connection is refused, as where there is no network."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _online_at(monkeypatch, f"http://127.0.0.1:{port}")


def _online_at(monkeypatch, endpoint: str) -> None:
    """huggingface_hub online (the tests run offline), its endpoint at `endpoint` (as HF_ENDPOINT sets it at import)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")


def test_mistyped_hub_id_fails_at_once_with_one_request(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepo)
    server.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _online_at(monkeypatch, f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(SourceError, match="nobody-here/no-such-modle: no such model on the Hub"):
            load_model("nobody-here/no-such-modle")
    finally:
        server.shutdown()
    assert _of_repositories(server.requests) == ["/nobody-here/no-such-modle/resolve/main/config.json"]  # no retries


def test_unreachable_hub_fails_within_seconds(monkeypatch):
    """No network (here: a port nobody listens on): one refused connection, said as such, not half a minute of
    retries."""
    _online_at_a_closed_port(monkeypatch)
    started = time.perf_counter()
    with pytest.raises(SourceError, match=r"owner/model: not a local folder, and could not reach the Hub \(.+\); "
                                          "offline, HF_HUB_OFFLINE=1 reads models cached before"):
        load_config("owner/model")
    assert time.perf_counter() - started < load.HUB_TIMEOUT_S


def test_silent_hub_fails_after_the_timeout(monkeypatch):
    """A Hub that takes the connection and never answers (here: a socket nobody accepts on) is given up on after
    HUB_TIMEOUT_S, and said so."""
    monkeypatch.setattr(load, "HUB_TIMEOUT_S", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        _online_at(monkeypatch, f"http://127.0.0.1:{silent.getsockname()[1]}")
        with pytest.raises(SourceError, match=r"owner/model: not a local folder, and the Hub did not answer within "
                                              r"0.5 s \(.+\); offline, HF_HUB_OFFLINE=1 reads models cached before"):
            load_config("owner/model")


def test_data_that_names_no_local_path_is_asked_of_the_hub_once(monkeypatch, tmp_path):
    """--data that names no local path is a `datasets` name: one request says that the Hub holds no such dataset (a
    mistyped folder, here `corpus`) or cannot be reached, where datasets would retry for half a minute and then not
    say that no such local path exists; convert says it before loading anything."""
    from click.testing import CliRunner

    from cli import main

    monkeypatch.chdir(tmp_path)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepo)
    server.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _online_at(monkeypatch, f"http://127.0.0.1:{server.server_address[1]}")
        result = CliRunner().invoke(main, ["convert", "demo", "-o", str(tmp_path / "out"), "--data", "corpus"])
    finally:
        server.shutdown()
    assert result.exit_code == 1
    assert ("error: --data corpus: no local file or folder of that name, and no dataset corpus on the Hub (check the "
            "name; a private one needs `hf auth login`)") in " ".join(result.output.split())
    assert [path.split("?")[0] for path in _of_repositories(server.requests)] == ["/api/datasets/corpus"]  # no retries
    _online_at_a_closed_port(monkeypatch)
    started = time.perf_counter()
    with pytest.raises(DataError, match=r"--data owner/corpus: no local file or folder of that name, and could not "
                                        r"reach the Hub to find it as a dataset \(.+\); offline, HF_HUB_OFFLINE=1"):
        locations.check_hub_dataset("owner/corpus")
    assert time.perf_counter() - started < locations.HUB_TIMEOUT_S


class _Answering(BaseHTTPRequestHandler):
    """A Hub that answers every request with the server's `answer`: (HTTP status, X-Error-Code or None)."""

    def do_GET(self):
        self.server.requests.append(self.path)
        status, code = self.server.answer
        self.send_response(status)
        if code is not None:
            self.send_header("X-Error-Code", code)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("answer", [(500, None), (404, "EntryNotFound")], ids=["refused", "no file"])
def test_a_dataset_the_hub_does_not_give_is_said_with_its_error(monkeypatch, answer):
    """An HTTP error other than a gated or missing dataset is said with the Hub's own line, after one request; so is
    one that a dataset's query does not get (a missing file, the answer to a request for a file)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answering)
    server.requests, server.answer = [], answer
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _online_at(monkeypatch, f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(DataError, match=r"--data owner/corpus: no local file or folder of that name, and the Hub "
                                            rf"did not give dataset owner/corpus \(.*{answer[0]}.*\)$"):
            locations.check_hub_dataset("owner/corpus")
    finally:
        server.shutdown()
    assert [path.split("?")[0] for path in _of_repositories(server.requests)] == ["/api/datasets/owner/corpus"]


@pytest.mark.parametrize("source", ["no such model!", "owner/x y", "a--b"])
def test_id_the_hub_cannot_hold_fails_before_any_request(monkeypatch, source):
    """Online (here at a port nobody listens on, which a request would report as unreachable): the id is refused
    as such, a SourceError naming it."""
    _online_at_a_closed_port(monkeypatch)
    with pytest.raises(SourceError, match=f"{source}: not a local folder, and not a Hub model id"):
        load_config(source)


def test_demo_source(monkeypatch, tmp_path):
    if (demo_model_path() / "model.safetensors").is_file():
        config, spec = load_config("demo")
        assert spec.family == "llama" and config.hidden_act == "silu"
    monkeypatch.setattr(locations, "demo_model_path", lambda: tmp_path / "absent")
    with pytest.raises(SourceError, match="make_demo.py"):
        load_model("demo")
