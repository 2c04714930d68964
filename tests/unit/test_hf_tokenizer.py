"""A Hugging Face folder's tokenizer (tokenizer.json + tokenizer_config.json) encodes,
decodes and renders its chat template exactly as `transformers` does with the same files."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from shared.tokenizer import IncrementalDetokenizer, Tokenizer

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Käse, crème brûlée and 東京 — emoji 🙂 too.",
    "def f(x):\n    return x * 2  # code, with  spaces",
] * 20
TEXTS = [
    "Hello world, the fox!",
    "crème 東京 🙂🙂 and unseen wörds",
    "<|im_start|>user\nhi<|im_end|>",
    "   leading and trailing   ",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 東京?"},
    {"role": "assistant", "content": "A city."},
    {"role": "user", "content": "And the fox?"},
]


def _folder(tmp_path, style: str):
    specials = (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        if style == "chatml"
        else ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rust.train_from_iterator(CORPUS, trainer)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024}
    if style == "chatml":
        config |= {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
        config["chat_template"] = CHATML
    else:
        bos = rust.token_to_id("<|begin_of_text|>")
        rust.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
        )
        config |= {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
        (tmp_path / "chat_template.jinja").write_text(LLAMA3)
    rust.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_folder_tokenizer_equals_transformers(tmp_path, style):
    transformers = pytest.importorskip("transformers")
    folder = _folder(tmp_path, style)
    ours = Tokenizer.from_model_path(folder)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=True) == theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids) == text
        stream = IncrementalDetokenizer(ours, skip_special_tokens=False)
        assert "".join(stream.add(i) for i in ids) + stream.flush() == text
    want = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES) == want
    eos = theirs.convert_tokens_to_ids(theirs.eos_token)
    assert ours.eos_token_id == eos and eos in ours.stop_token_ids
    assert ours.special_token_ids == frozenset(theirs.all_special_ids) | {
        theirs.convert_tokens_to_ids(t) for t in theirs.added_tokens_encoder
    }


def test_two_copies_share_a_fingerprint_and_a_changed_vocab_does_not(tmp_path):
    for name in "abc":
        (tmp_path / name).mkdir()
    a = Tokenizer.from_hf_folder(_folder(tmp_path / "a", "chatml"))
    b = Tokenizer.from_hf_folder(_folder(tmp_path / "b", "chatml"))
    assert a.fingerprint == b.fingerprint
    c = Tokenizer.from_hf_folder(_folder(tmp_path / "c", "llama3"))
    assert c.fingerprint != a.fingerprint


def test_unigram_tokenizer_is_refused_by_name(tmp_path):
    rust = RustTokenizer(models.Unigram())
    rust.pre_tokenizer = pre_tokenizers.Metaspace()
    rust.decoder = decoders.Metaspace()
    rust.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=100))
    rust.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="model 'Unigram'"):
        Tokenizer.from_hf_folder(tmp_path)


def test_coordinator_serves_a_folder_with_its_tokenizer(tmp_path):
    """The coordinator (torch-free) reads a folder's context length and tokenizer."""
    from services.coordinator.main import model_infos
    from shared.config.schema import parse_config

    folder = _folder(tmp_path, "chatml")
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 400,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
    }
    (folder / "config.json").write_text(json.dumps(config))
    deployment = parse_config({"models": [{"id": "tiny-qwen3", "path": str(folder)}]})
    (info,) = model_infos(deployment)
    assert info.context_length == 4096
    assert info.tokenizer.fingerprint == Tokenizer.from_hf_folder(folder).fingerprint


@pytest.mark.parametrize("prepend", ["always", "never"])
def test_sentencepiece_style_folder_equals_transformers(tmp_path, prepend):
    """Gemma / Llama 2 style: "▁" spaces, byte pieces for what the vocabulary lacks."""
    transformers = pytest.importorskip("transformers")
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend)
    specials = ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
    rust.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    spec = json.loads(rust.to_str())
    # Byte pieces are ordinary vocabulary entries (as in Gemma's), reached by byte fallback.
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = max(vocab.values()) + 1
    spec["model"]["byte_fallback"] = True
    steps = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if prepend == "always":
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    spec["decoder"] = {"type": "Sequence", "decoders": steps}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": CHATML})
    )
    ours = Tokenizer.from_hf_folder(tmp_path)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    for text in [*TEXTS[:2], "Zürich ☃ unseen ÿ bytes", "two  spaces\nnewline"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids) == text
        stream = IncrementalDetokenizer(ours)
        streamed = "".join(stream.add(i) for i in ids) + stream.flush()
        assert streamed.removeprefix(" ") == text
