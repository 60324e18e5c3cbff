"""The `kvserve` command line.

    kvserve generate "PROMPT" [sampling flags] [engine flags]   stream one completion to stdout
    kvserve serve [--host H] [--port P] [serve flags] [engine flags]   the OpenAI-compatible server

Errors a user can fix (bad flag values, a model directory that cannot be used) are printed as
one `kvserve: error: ...` line on stderr with exit status 2, never as a traceback. The engine is
imported only once a command runs, so `kvserve --help` does not load torch.
"""
from __future__ import annotations

import argparse
import os
import sys

from cluster.engine_args import add_engine_args, engine_config_from_args
from cluster.serve_cli import add_serve_parser
from cluster.vllm_argv import dashed_flags, dotted_json_flags, expand_config
from engine.version import kvserve_version


class _Parser(argparse.ArgumentParser):
    # No abbreviations: a vLLM flag this CLI lacks must not be read as another flag it prefixes
    # (`--max-num-seq`), and a flag added later must not change what an abbreviation meant.
    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    # Usage errors in the same one-line shape as every other error of the CLI.
    def error(self, message: str):
        self.exit(2, f"kvserve: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvserve", description="kvserve: a paged-KV LLM serving system.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvserve_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser(
        "generate", help="generate a completion for one prompt and stream it to stdout",
        description="Generate a completion for PROMPT with the offline engine, streamed to stdout.")
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--no-chat", dest="chat", action="store_false",
                     help="send PROMPT as raw text instead of as a user message in the chat template")
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=256, metavar="N",
                          help="most tokens to generate (default: 256)")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="T",
                          help="0 is greedy (default: 0.0)")
    sampling.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass in (0, 1]")
    sampling.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens")
    add_engine_args(gen)  # its --seed also seeds this request's sampler
    gen.set_defaults(func=_generate, parser=gen)
    serve = add_serve_parser(commands)
    for sub in (gen, serve):  # read before parsing (cluster.vllm_argv); here for --help
        sub.add_argument("--config", metavar="FILE.yaml",
                         help="flags from a YAML file, as vLLM's: `max-model-len: 2048`, `tensor-parallel-size: 2`, "
                              "`enable-prefix-caching: false` (and for serve `port: 8000`); flags on the command "
                              "line win over it")
    return parser


def _flags(parser: argparse.ArgumentParser, command: str | None = None) -> set[str]:
    """Every option string of the sub-command `command`, or of them all when it is none of them."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    subs = [commands.choices[command]] if command in commands.choices else commands.choices.values()
    return {flag for sub in subs for flag in sub._option_string_actions}


def vllm_argv(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with vLLM's spellings (--config FILE, --max_num_seqs, --speculative-config.key V)
    in the ones argparse reads (cluster.vllm_argv)."""
    flags = _flags(parser, argv[0] if argv else None)
    return dotted_json_flags(dashed_flags(expand_config(argv, flags.__contains__)))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = vllm_argv(parser, sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        parser.exit(2, f"kvserve: error: {e}\n")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, so that its hint names `kvserve serve --help`
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


def _fail(error: Exception) -> int:
    print(f"kvserve: error: {error}", file=sys.stderr)
    return 2


def _generate(args: argparse.Namespace) -> int:
    from engine.model_source import ModelError

    try:
        llm, prompt, params = _prepare_generate(args)
    except (ModelError, ValueError) as e:
        return _fail(e)
    try:
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    except ValueError as e:  # the engine refused the request (a prompt over max_model_len, ...)
        return _fail(e)
    except BrokenPipeError:
        # The reader went away (`| head`); point stdout at devnull so the exit flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _prepare_generate(args: argparse.Namespace):
    from engine import LLM, EngineConfig, SamplingParams
    from engine.model.loader import load_arch
    from engine.model.quantized import check_method
    from engine.model_source import model_dir, tokenizer_dir

    # Validate the cheap things first (the model's config.json, not its weights, as `kvserve serve`
    # does), so a typo or a --max-model-len past the model's positions fails in seconds.
    engine_kwargs = engine_config_from_args(args)
    config = EngineConfig(**engine_kwargs)
    folder = model_dir(config)
    tokenizer_dir(config, folder)
    arch, _ = load_arch(folder)
    check_method(config.quantization, arch.quantization)
    config.model_len(arch.max_position_embeddings)
    if config.tensor_parallel_size > 1:
        arch.check_tp(config.tensor_parallel_size)
    optional = {k: getattr(args, k) for k in ("top_p", "top_k", "seed") if getattr(args, k, None) is not None}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, **optional)

    llm = LLM(**engine_kwargs)
    return llm, _format_prompt(llm.tokenizer, args.prompt, args.chat), params


def _format_prompt(tokenizer, prompt: str, chat: bool) -> str | list[int]:
    """The text as given (the engine adds the tokenizer's special tokens), or the chat template's
    tokens: tokenized without them, as the template writes its own (a BOS added again would make
    two, as with Llama 3's)."""
    if not chat:
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use --no-chat for raw text")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


if __name__ == "__main__":
    sys.exit(main())
