"""`systemone`: the command line. It sits above export/, runtime/ and server/ (it drives all three), so it lives in
the top package."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from .artifact_cache import CACHE_ENV, default_cache_dir, servable
from .install import missing_module_hint, require_export_extra
from .runtime.batch import MAX_BATCH_TOKENS
from .runtime.devices import DEVICES

if TYPE_CHECKING:
    from .runtime.media_fetch import FetchPolicy

API_KEY_ENV = "SYSTEMONE_API_KEY"

DESCRIPTION = """Serve decision models (d1, d3) on onnxruntime: POST /v1/systemone answers as vLLM does.

Start here:
  systemone serve MODEL            MODEL: a hub id, a checkpoint directory or an exported artifact; a checkpoint is
                                   exported once into a cache (minutes), later starts serve it at once
  systemone ask MODEL --request scripts/demo_request.json
                                   answer one request without a server
  systemone doctor [ARTIFACT]      what this machine can run, and what serve would use; exits 1 if serve would fail
"""
EPILOG = "`systemone COMMAND --help` lists a command's flags with their defaults; docs/cli.md says why."


class UserError(Exception):
    """A mistake in how the command was called: one line on stderr, no traceback."""


def _load_request(path: str) -> Any:
    if path != "-" and not Path(path).is_file():
        raise UserError(f"request file {path!r} does not exist")
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"request file {path!r} is not valid JSON: {exc}") from None


def fetch_policy(args: argparse.Namespace, environ: Mapping[str, str]) -> FetchPolicy:
    """The media flags as a FetchPolicy; the proxy from `environ` unless --no-media-proxy."""
    from .runtime.media_fetch import FetchPolicy
    from .runtime.media_proxy import ProxySettings

    return FetchPolicy(
        allowed_local_path=Path(args.allowed_local_media_path) if args.allowed_local_media_path else None,
        allowed_domains=frozenset(args.allowed_media_domains) if args.allowed_media_domains else None,
        allow_private_hosts=args.allow_private_media_hosts, max_bytes=args.max_media_bytes,
        image_timeout_s=args.image_fetch_timeout, video_timeout_s=args.video_fetch_timeout,
        attempts=args.media_fetch_attempts,
        proxies=ProxySettings() if args.no_media_proxy else ProxySettings.from_environment(environ))


def _cache_dir(args: argparse.Namespace) -> Path:
    return Path(args.cache_dir).expanduser() if getattr(args, "cache_dir", None) else default_cache_dir()


def _served_artifact(args: argparse.Namespace) -> None:
    """Point `args.artifact` at the artifact to load: the one given, or the cached export of the checkpoint given."""
    with _quiet_third_party():  # the exporter's torch warnings, when a first start exports
        args.artifact = str(servable(args.artifact, _cache_dir(args), revision=args.revision))


def _service(args: argparse.Namespace):
    from .runtime.artifact import Artifact
    from .runtime.media_allowance import MediaBudget
    from .runtime.engine import EngineOptions
    from .runtime.pixel_workers import default_processes
    from .runtime.service import DEFAULT_ALIASES, DecisionService, MediaLimits

    options = EngineOptions(device=args.device, max_model_len=args.max_model_len,
                            max_batch_tokens=args.max_batch_tokens, fetch_policy=fetch_policy(args, os.environ),
                            form=args.form, gpu_memory=_gib_bytes(args.gpu_memory),
                            cuda_graphs=not args.no_cuda_graphs, prefix_reuse=not args.no_prefix_reuse)
    return DecisionService(Artifact.load(args.artifact), options, served_model_names=args.served_model_name or None,
                           media_limits=MediaLimits(args.limit_images, args.limit_videos),
                           aliases=() if args.no_jev_latest_alias else DEFAULT_ALIASES,
                           media_workers=args.media_workers,
                           media_processes=(default_processes() if args.media_processes is None
                                            else args.media_processes),
                           media_budget=MediaBudget(args.max_request_pixels, args.max_request_media_bytes,
                                                    args.max_video_frame_pixels, args.max_jpeg_video_frames,
                                                    args.max_video_decode_pixels, args.max_server_media_pixels,
                                                    args.max_server_media_bytes))


def _gib_bytes(gib: float | None) -> int | None:
    """`--gpu-memory GIB` in bytes (None: unbounded)."""
    return int(gib * (1 << 30)) if gib else None


def _print_error(exc: Exception) -> int:
    from .models.errors import DecisionError, SchemaError
    from .server.errors import error_body, http_status

    if isinstance(exc, SchemaError):
        body: Any = {"detail": [i.as_dict() for i in exc.issues]}
    elif isinstance(exc, DecisionError):
        status, kind = http_status(exc)
        body = error_body(status, exc.message, kind, exc.param)
    else:
        raise exc
    print(json.dumps(body, ensure_ascii=False, indent=2))
    return 1


def cmd_export(args: argparse.Namespace) -> int:
    require_export_extra()
    from .export.pipeline import add_forms, export_checkpoint

    if args.portable_only and (args.forms or args.add_forms):
        other = "--forms" if args.forms else "--add-forms"
        print(f"systemone export: --portable-only writes no half-precision form; it cannot go with {other}",
              file=sys.stderr)
        return 2
    forms = ["portable"] if args.portable_only else args.forms.split(",") if args.forms else None
    if args.add_forms:
        add_forms(args.source, args.out, revision=args.revision, forms=forms, gate_device=args.gate_device,
                  jobs=args.jobs, weights=args.weights)
    else:
        export_checkpoint(args.source, args.out, revision=args.revision, atol=args.atol, prob_atol=args.prob_atol,
                          overwrite=args.overwrite, forms=forms, gate_device=args.gate_device, jobs=args.jobs,
                          weights=args.weights)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .server.auth import is_loopback
    from .server.connections import event_loop, http_protocol
    from .server.lifecycle import PortUnavailable, bind_listener

    api_key = (args.api_key or os.environ.get(API_KEY_ENV) or "").strip() or None
    if api_key is None and not is_loopback(args.host) and not args.allow_unauthenticated:
        print(f"refusing to serve on {args.host} without an API key: set --api-key (or {API_KEY_ENV}), bind a "
              "loopback address, or pass --allow-unauthenticated", file=sys.stderr)
        return 2
    if args.replicas is not None or args.min_replicas is not None or args.max_replicas is not None:
        from .ray_serve import serve_on_ray

        return serve_on_ray(args, api_key)
    try:  # before the model loads: a parser or loop asked for by name must be installed
        (parser, protocol), loop = http_protocol(args.http), event_loop(args.loop)
    except ImportError as exc:
        print(f"systemone serve: {exc}", file=sys.stderr)
        return 2
    try:  # before the model loads (or a first start exports): a busy port is found at once
        listener = bind_listener(args.host, args.port)
    except PortUnavailable as exc:
        print(f"systemone serve: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve_on(args, listener, parser, protocol, loop, api_key)
    finally:
        listener.close()


def _serve_on(args: argparse.Namespace, listener: Any, parser: str, protocol: type, loop: str,
              api_key: str | None) -> int:
    import logging

    from .server import lifecycle
    from .server.allocator import release_freed_memory
    from .server.connections import AcceptFailureFilter, guarded_http_settings, raise_descriptor_limit

    # uvicorn's "trace" is below DEBUG and unknown to logging.basicConfig
    level = 5 if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("asyncio").addFilter(AcceptFailureFilter())
    # Connections stay below the descriptor limit (model files, media sockets and logs need some too).
    max_connections = min(args.max_connections, max(16, raise_descriptor_limit() - 256))
    released = release_freed_memory()  # before the service allocates: the settings hold from here on
    service, app, kept = served_app(args, api_key)
    try:
        _print_summary(service, args, port=listener.getsockname()[1])
        print(f"systemone serve: {'batch rows':<13} {app.state.batch_sizing.describe()}{kept}", flush=True)
        print(f"systemone serve: {'http':<13} {parser} parser, {loop} event loop", flush=True)
        print(f"systemone serve: {'allocator':<13} "
              + ("buffers of 1 MiB and more unmapped when freed, up to 16 MiB kept free atop each of 2 malloc arenas"
                 if released
                 else "the C library's defaults (not glibc)"), flush=True)
        # uvicorn's access log repeated each decision request's own line: 5.6% of the event loop's time under
        # text-only load (tiny d3 on two cores, py-spy), where the loop is what bounds requests/s.
        lifecycle.run_server(app, listener, app.state.in_flight.stop, log_level=args.log_level,
                             access_log=args.access_log, timeout_graceful_shutdown=int(args.request_timeout) + 5,
                             **guarded_http_settings(args.header_timeout, max_connections,
                                                     args.max_connections_per_client, base=protocol),
                             loop=loop,
                             # One over the cap: the guard keeps connections at it (a new one displacing a waiting
                             # one), and uvicorn answers 503 from `limit_concurrency` connections on.
                             limit_concurrency=max_connections + 1,
                             timeout_keep_alive=5)
    finally:
        service.close()
    return 0


def served_app(args: argparse.Namespace, api_key: str | None) -> tuple[Any, Any, str]:
    """The service and app `serve`'s flags `args` make (the artifact exported first where a checkpoint is given),
    and where the batch rows came from: one `systemone serve`, or one replica of it (systemone/ray_serve.py)."""
    from .batch_rows import kept_batch_sizing
    from .server.app import create_app
    from .server.options import ServerOptions

    options = ServerOptions(api_key=api_key, max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                            request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes,
                            log_requests=args.log_requests, max_body_memory=args.max_body_memory,
                            max_batch_rows=args.max_batch_rows, batch_wait_ms=args.batch_wait_ms)
    _served_artifact(args)
    service = _service(args)
    try:
        kept = ""
        if args.max_batch_rows is None:  # the choice kept for this artifact on this machine, else measured and kept
            _, path, measured = kept_batch_sizing(service, _cache_dir(args), _gib_bytes(args.gpu_memory))
            kept = f"; {'measured now, kept in' if measured else 'kept from an earlier start:'} {path}"
        return service, create_app(service, options), kept
    except BaseException:
        service.close()
        raise


def _print_summary(service: Any, args: argparse.Namespace, port: int) -> None:
    """What `serve` is about to serve, before uvicorn's own lines."""
    manifest = service.artifact.manifest
    aliases = f" (also answers to {', '.join(service.aliases)})" if service.aliases else ""
    form = service.form
    if form in manifest.forms:
        entry = manifest.forms[form]
        graphs = ", ".join(f"{graph} {name}" for graph, name in entry.precisions.items()) or entry.dtype
        precision = f"{form} form ({graphs}, readout float32; gate: {entry.gate.get('summary', '-')})"
    else:
        precision = f"portable form ({', '.join(sorted({g.dtype for g in manifest.graphs.values()}))})"
    # Media and shared batches are optional parts of a family's engine (runtime/engine.py): say when one is absent.
    media, budget = service.engine.media, service.engine.budget
    if media is None:
        proxy = "none: this family takes no media"
    else:
        proxy = (media.policy.proxies.describe()
                 or "none: media URLs are fetched directly" + (" (--no-media-proxy)" * args.no_media_proxy))
    batch_tokens = (f"{budget.max_batch_tokens} padded tokens a call at most" if budget is not None
                    else "one request a call: this family's engine shares no batches")
    if not service.engine.reads_prefixes:
        reuse = "none: the text graph carries no state (d3's bidirectional mode), every whole prompt is read"
    elif args.no_prefix_reuse:
        reuse = "off (--no-prefix-reuse): every whole prompt is read"
    else:
        reuse = "on: a request's shared prefix read once where it saves more than a call"
    for key, value in (("model", ", ".join(service.served_model_names) + aliases),
                       ("artifact", f"{args.artifact} (family {manifest.family}, source {manifest.source})"),
                       ("provider", f"{service.provider} (--device {args.device})"), ("precision", precision),
                       ("cuda graphs", service.cuda_graphs),
                       ("media", service.media_pool.describe()),
                       ("proxy", proxy),
                       ("max model len", str(service.max_model_len)),
                       ("batch tokens", batch_tokens),
                       ("prefix reuse", reuse),
                       ("address", f"http://{_url_host(args.host)}:{port}/v1/systemone")):
        print(f"systemone serve: {key:<13} {value}", flush=True)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import run_doctor

    findings = run_doctor(args.artifact, args.device, _cache_dir(args))
    for line in findings.lines:
        print(line)
    return 1 if findings.serve_fails else 0


def _print_result(args: argparse.Namespace, produce: Callable[[Any, Any], Any]) -> int:
    """Load the artifact and the request, print `produce(service, body)` as JSON (or the error body, exit 1)."""
    from .models.errors import DecisionError, SchemaError

    body = _load_request(args.request)  # before the artifact's seconds of loading: a typo fails at once
    _served_artifact(args)
    service = _service(args)
    try:
        result = produce(service, body)
    except (DecisionError, SchemaError) as exc:
        return _print_error(exc)
    print(json.dumps(result, ensure_ascii=False, indent=2))
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    return _print_result(args, lambda service, body: service.decide(body))


def cmd_render(args: argparse.Namespace) -> int:
    from .models.errors import DecisionError, SchemaError

    body = _load_request(args.request)
    _served_artifact(args)
    service = _service(args)
    try:
        prompts = service.render(body)
    except (DecisionError, SchemaError) as exc:
        return _print_error(exc)
    if args.format == "json":
        print(json.dumps({"model": service.model_name, "questions": [
            {"id": p.question.id, "tokens": len(p.token_ids), "text": p.text, "token_ids": p.token_ids}
            for p in prompts]}, ensure_ascii=False))
    for p in prompts if args.format != "json" else ():
        if args.format == "ids":
            print(f"{p.question.id}: {' '.join(map(str, p.token_ids))}")
        else:
            print(f"--- {p.question.id} ({len(p.token_ids)} tokens)\n{p.text}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench, write_report

    if args.serve:
        from .loadgen import run_load

        pids = ({name: pid for name, pid in (("server", args.server_pid), ("reference", args.reference_pid)) if pid}
                if args.gpu_memory_peaks else None)
        report = run_load(args.serve, args.family, tuple(args.clients), args.seconds, args.model, args.reference,
                          tuple(args.kinds), pids, timeout_s=args.timeout, processes=args.processes,
                          max_processes=args.max_processes, ceiling_seconds=args.ceiling_seconds,
                          published=args.published, warm_up_s=args.warm_up)
        if args.out:
            write_report(report, Path(args.out))
        return 0
    if not args.checkpoint or not args.artifact:
        print("systemone bench: give CHECKPOINT and --artifact (or --serve URL for a load run)", file=sys.stderr)
        return 2
    report = run_bench(Path(args.checkpoint), Path(args.artifact), args.device, tuple(args.batches),
                       tuple(args.lengths), args.repeats, args.request_repeats, tuple(args.torch_dtypes),
                       forms=tuple(args.forms) if args.forms else None, gpu_memory=_gib_bytes(args.gpu_memory),
                       cuda_graphs=not args.no_cuda_graphs, torch_cuda_graphs=not args.no_torch_cuda_graphs,
                       shapes=tuple(args.shapes) if args.shapes else None)
    if args.out:
        write_report(report, Path(args.out))
    else:
        print(json.dumps(report, indent=2))
    return 0


def _runtime_options(parser: argparse.ArgumentParser) -> None:
    from .runtime.media_allowance import MEDIA_WORKERS, MediaBudget, MediaLimits
    from .runtime.media_fetch import FetchPolicy

    # The runtime's defaults, written once where they are used.
    fetch, limits, budget = FetchPolicy(), MediaLimits(), MediaBudget()
    parser.add_argument("artifact", metavar="MODEL",
                        help="an exported artifact directory (it has a manifest.json), or a checkpoint: a hub id "
                             "(owner/name) or a checkpoint directory, exported on first use into the cache "
                             "(--cache-dir) and served from there on later starts")
    parser.add_argument("--cache-dir", default=None,
                        help=f"where checkpoints are exported to (default: ${CACHE_ENV}, else "
                             "$XDG_CACHE_HOME/systemone, else ~/.cache/systemone)")
    parser.add_argument("--revision", default=None, help="hub revision of a hub id (default: the default branch)")
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="execution provider; one that is absent is an error")
    parser.add_argument("--form", default="auto",
                        help="which of the artifact's forms to run: auto (the half-precision CUDA form on cuda where "
                             "export wrote one, else the portable fp32 graphs), portable, or a form's name")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="most GiB each graph's CUDA memory arena may hold (default: unbounded)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run every text-graph call uncaptured (by default, on CUDA, small batches replay CUDA "
                             "graphs captured at start-up where the form allows it)")
    parser.add_argument("--no-prefix-reuse", action="store_true",
                        help="read every question's whole prompt (by default d1 and causal d3 read the prefix a "
                             "request's questions share once, then each question on its state, where that saves "
                             "more than the call it adds)")
    parser.add_argument("--served-model-name", action="append", default=[],
                        help="name(s) the model answers to; the first is reported (default: the checkpoint's own "
                             "name from the manifest: the hub id, or the checkpoint directory's name)")
    parser.add_argument("--no-jev-latest-alias", action="store_true",
                        help="refuse the model name `jev-latest` (by default it reaches the served model, as "
                             "TypeSafe's SDK sends it unless told otherwise)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt in tokens (None: the model's positions); nothing is truncated")
    parser.add_argument("--max-batch-tokens", type=int, default=MAX_BATCH_TOKENS,
                        help="most padded tokens one text-graph call holds, which bounds the memory its activations "
                             "take; d3 needs at least --max-model-len (a prompt is one call)")
    media = parser.add_argument_group("media fetching (safe by default)")
    media.add_argument("--allowed-local-media-path", default=None, help="directory file:// URLs may read from")
    media.add_argument("--allowed-media-domains", action="append", default=[],
                       help="only these hostnames (exact match) may be fetched; repeat for several")
    media.add_argument("--allow-private-media-hosts", action="store_true",
                       help="allow hosts that resolve to private, loopback or link-local addresses")
    media.add_argument("--max-media-bytes", type=int, default=fetch.max_bytes, help="largest media download (413 over)")
    media.add_argument("--limit-images", type=int, default=limits.images, help="most images per request")
    media.add_argument("--limit-videos", type=int, default=limits.videos, help="most videos per request")
    media.add_argument("--image-fetch-timeout", type=float, default=fetch.image_timeout_s,
                       help="seconds a whole image fetch may take (connect, headers, body; 422 after)")
    media.add_argument("--video-fetch-timeout", type=float, default=fetch.video_timeout_s, help="the same for a video")
    media.add_argument("--media-fetch-attempts", type=_positive_int, default=fetch.attempts,
                       help="tries of a media URL whose failure may pass (HTTP 5xx, a connection refused or cut): "
                            "1 s, then 4 s apart, within the request's time; a try that times out is not repeated")
    media.add_argument("--no-media-proxy", action="store_true",
                       help="fetch media URLs directly even where http_proxy, https_proxy or all_proxy is set "
                            "(by default they are honoured, and no_proxy too)")
    media.add_argument("--media-workers", type=int, default=MEDIA_WORKERS,
                       help="threads of each of the two media lanes (media fetched over the network; inline and "
                            "local media), shared by all requests")
    media.add_argument("--media-processes", type=int, default=None,
                       help="processes that resize media into pixel rows, shared by all requests; 0: threads of "
                            "the server's process (default: all cores but two, at most 16; none below 6 cores)")
    media.add_argument("--max-request-pixels", type=int, default=budget.pixels,
                       help="decoded pixels of one request's images and sampled video frames, from their headers")
    media.add_argument("--max-request-media-bytes", type=int, default=budget.download_bytes,
                       help="bytes one request's media URLs may download in all")
    media.add_argument("--max-server-media-pixels", type=int, default=budget.server_pixels,
                       help="decoded pixels of every request's media being loaded at once (503 past it)")
    media.add_argument("--max-server-media-bytes", type=int, default=budget.server_download_bytes,
                       help="bytes every request's media URLs being fetched at once may hold (503 past it)")
    media.add_argument("--max-video-frame-pixels", type=int, default=3840 * 2160, help="largest video frame")
    media.add_argument("--max-jpeg-video-frames", type=int, default=64, help="most frames of a data:video/jpeg")
    media.add_argument("--max-video-decode-pixels", type=int, default=10_000_000_000,
                       help="pixels decoded to reach one video's sampled frames, skipped frames included")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, except on/off switches and help that already states its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or isinstance(action.default, bool):
            return text
        return super()._get_help_string(action) or text


class _Parser(argparse.ArgumentParser):
    """A mistake in the arguments is one line, not the usage of every flag before it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _TopHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description's lines as written (an example per line), the commands' help as argparse wraps it."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _shape(text: str) -> tuple[int, int]:
    batch, _, length = text.partition("x")
    if not (batch.isdigit() and length.isdigit() and int(batch) > 0 and int(length) > 0):
        raise argparse.ArgumentTypeError(f"a token batch is BATCHxLENGTH, e.g. 8x1000; got {text!r}")
    return int(batch), int(length)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a number from 1 to 65535 (0: any free port), got {text!r}")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 1 to 65535 (0: any free port), got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("systemone-onnx")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    from .loadgen import ALL_KINDS, DEFAULT_TIMEOUT_S, KINDS, PUBLISHED
    from .models.registry import FAMILIES
    from .server.options import ConnectionLimits, ServerOptions

    served, guard = ServerOptions(), ConnectionLimits()  # serve's defaults, written once
    formatter = _HelpFormatter
    parser = _Parser(prog="systemone", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=_TopHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="show tracebacks and third-party warnings instead of one-line errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")

    export = sub.add_parser("export", help="write a checkpoint (a directory or hub id) as an ONNX artifact "
                            "directory, checked against torch first (needs the [export] extra; serve does this by "
                            "itself for a checkpoint)", parents=[common], formatter_class=formatter)
    export.add_argument("source", help="a local checkpoint directory or a hub id (owner/name)")
    export.add_argument("--out", required=True, help="the artifact directory to write")
    export.add_argument("--revision", default=None, help="hub revision (None: the default branch)")
    export.add_argument("--atol", type=float, default=2e-3, help="max |code logit diff| vs torch")
    export.add_argument("--prob-atol", type=float, default=1e-4, help="max |probability diff| vs torch")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")
    export.add_argument("--portable-only", action="store_true",
                        help="write only the portable fp32 graphs (the same as --forms portable)")
    export.add_argument("--forms", metavar="NAME[,NAME]",
                        help="what to write: portable (the fp32 graphs every provider runs) and the half-precision "
                             "forms to try, in the family's order (default: the CUDA forms where CUDA can gate them, "
                             "else the portable graphs; export prints which and why)")
    export.add_argument("--add-forms", action="store_true",
                        help="write the half-precision forms onto --out, an artifact already exported from SOURCE "
                             "(for a gate on the forms' device); its portable graphs are kept")
    export.add_argument("--gate-device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where the half-precision form's answer gate runs (auto: CUDA when onnxruntime has it)")
    export.add_argument("--jobs", type=_positive_int, default=1,
                        help="graphs traced at once, each in a worker process (a trace is one core for a minute or "
                             "more at the released sizes, and holds no weights)")
    export.add_argument("--weights", default="copy", choices=["copy", "link"],
                        help="copy: the artifact holds its weights in its own files; link: weights used as the "
                             "checkpoint stores them (the form converts them when it loads) are read from the "
                             "checkpoint's files, hard-linked into the artifact: no disk for a second copy "
                             "(docs/artifact.md)")
    export.set_defaults(func=cmd_export)

    serve = sub.add_parser("serve", help="serve a model over HTTP: POST /v1/systemone, GET /v1/models, /health, "
                           "/metrics, /docs", parents=[common], formatter_class=formatter)
    _runtime_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind")
    serve.add_argument("--port", type=_port, default=8000,
                       help="port to bind, 1-65535; 0 takes any free port (the address line says which)")
    serve.add_argument("--api-key", default=None,
                       help=f"require Authorization: Bearer KEY (or set {API_KEY_ENV}); without one the header is "
                            "ignored")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="serve on a non-loopback address without an API key")
    serve.add_argument("--max-concurrency", type=int, default=served.max_concurrency,
                       help="requests admitted to the scheduler at once (their questions share batches)")
    serve.add_argument("--max-queue", type=int, default=served.max_queue, help="requests waiting for admission; more get 503")
    serve.add_argument("--max-batch-rows", type=_positive_int, default=served.max_batch_rows,
                       help="most questions one text-graph call takes (default: measured at start-up)")
    serve.add_argument("--batch-wait-ms", type=_non_negative_float, default=served.batch_wait_ms,
                       help="how long a call that could take more questions waits for them")
    serve.add_argument("--request-timeout", type=float, default=served.request_timeout_s, help="seconds a request may take (503 after)")
    serve.add_argument("--max-body-bytes", type=int, default=served.max_body_bytes,
                       help="largest request body, compressed or decompressed (413 over it)")
    serve.add_argument("--log-requests", action="store_true", help="log request bodies (they hold the state)")
    serve.add_argument("--max-body-memory", type=int, default=served.max_body_memory,
                       help="bytes that request bodies may hold before admission: received bytes, then an upper "
                            "bound of what parsing each takes (413 for a body over it alone, 503 + Retry-After "
                            "while others hold it)")
    serve.add_argument("--header-timeout", type=float, default=guard.header_timeout_s,
                       help="seconds a connection may take to send a request's headers (then it is closed)")
    serve.add_argument("--max-connections", type=int, default=guard.max_connections,
                       help="open connections (kept below the descriptor limit); past it a new one displaces the one "
                            "waiting longest for its request's headers, or is closed if every one has a request")
    serve.add_argument("--max-connections-per-client", type=_non_negative_int, default=guard.max_per_client,
                       help="open connections from one client address; more are closed at once (0: no such cap; "
                            "behind a reverse proxy every connection has the proxy's address)")
    serve.add_argument("--http", choices=("auto", "httptools", "h11"), default="auto",
                       help="the HTTP parser (auto: httptools where it is installed, else h11)")
    serve.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                       help="the event loop (auto: uvloop where it is installed, else asyncio)")
    serve.add_argument("--access-log", action="store_true",
                       help="uvicorn's line for every HTTP request too (decision requests are logged once anyway)")
    serve.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug", "trace"), help="server log level")
    ray = serve.add_argument_group("replicas on Ray Serve (the [ray] extra; docs/operations.md)")
    ray.add_argument("--replicas", type=_positive_int, default=None,
                     help="serve N replicas of this server on Ray Serve behind one address, each a whole engine "
                          "(with --device cuda, one GPU each); a replica lost with requests in flight has them "
                          "answered by another, or 503 + Retry-After")
    ray.add_argument("--min-replicas", type=_positive_int, default=None,
                     help="with --max-replicas: autoscale between the two on the requests in flight")
    ray.add_argument("--max-replicas", type=_positive_int, default=None, help="see --min-replicas")
    ray.add_argument("--replica-ongoing", type=_positive_int, default=64,
                     help="requests a replica holds at once; more wait at the front (its own --max-concurrency and "
                          "--max-queue still apply within)")
    ray.add_argument("--ray-address", default=None,
                     help="the Ray cluster to join (default: RAY_ADDRESS, else a local one started here)")
    serve.set_defaults(func=cmd_serve)

    doctor = sub.add_parser("doctor", help="check what this machine can run (onnxruntime, providers, GPUs, CUDA "
                            "libraries) and, given an artifact, what serve would use; exits 1 where serve would "
                            "fail", parents=[common], formatter_class=formatter)
    doctor.add_argument("artifact", nargs="?", default=None, metavar="ARTIFACT",
                        help="an exported artifact directory (optional): its forms, the provider and the rows a "
                             "call serve would choose")
    doctor.add_argument("--device", default="auto", choices=DEVICES, help="the device serve would be asked for")
    doctor.add_argument("--cache-dir", default=None,
                        help=f"where serve keeps its choices (default: ${CACHE_ENV}, else $XDG_CACHE_HOME/systemone, "
                             "else ~/.cache/systemone)")
    doctor.set_defaults(func=cmd_doctor)

    bench = sub.add_parser("bench", help="time an artifact against the checkpoint's own runtime (transformers with "
                           "its default attention and flash-linear-attention where it imports; needs the [export] "
                           "extra), or load a running server with --serve", parents=[common],
                           formatter_class=formatter)
    bench.add_argument("checkpoint", nargs="?", help="the checkpoint directory the artifact was exported from")
    bench.add_argument("--artifact", help="the exported artifact directory")
    bench.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both sides run")
    bench.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64], help="token-batch sizes")
    bench.add_argument("--lengths", type=int, nargs="+", default=[200, 1000], help="token-batch prompt lengths")
    bench.add_argument("--shapes", type=_shape, nargs="+", default=None, metavar="BxL",
                       help="token batches as batch x length (e.g. 1x200 8x1000), instead of --batches x --lengths")
    bench.add_argument("--repeats", type=_positive_int, default=10,
                       help="timed runs per token batch of each side, the runtime's and torch's taken in turn "
                            "(after a warm-up call of each)")
    bench.add_argument("--request-repeats", type=int, default=30, help="timed whole requests per kind")
    bench.add_argument("--torch-dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"],
                       help="the dtypes torch is timed in (the check against fp32 torch runs whatever is timed)")
    bench.add_argument("--no-torch-cuda-graphs", action="store_true",
                       help="time torch at batch 1 in eager only (by default, on CUDA, also replaying a CUDA graph)")
    bench.add_argument("--forms", nargs="+", default=None,
                       help="the artifact's forms to run (default: every one it has for --device)")
    bench.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                       help="most GiB each graph's CUDA arena may hold, as serve's flag")
    bench.add_argument("--no-cuda-graphs", action="store_true", help="as serve's flag")
    bench.add_argument("--out", default=None, help="also write the JSON report here (e.g. scripts/results/)")
    load = bench.add_argument_group("load run (--serve): the seeds' request mix, N clients in a closed loop")
    load.add_argument("--serve", metavar="URL", help="POST endpoint of a running server, e.g. "
                      "http://127.0.0.1:8000/v1/systemone")
    load.add_argument("--reference", metavar="URL", help="a reference server's endpoint, run on the same requests")
    load.add_argument("--gpu-memory-peaks", action="store_true",
                      help="report the most GPU memory the device held in each run (nvidia-smi), and each server "
                           "process given below")
    load.add_argument("--server-pid", type=int, default=None, help="the server's process id")
    load.add_argument("--reference-pid", type=int, default=None, help="the reference server's process id")
    load.add_argument("--family", default="d3", choices=[entry.name for entry in FAMILIES],
                      help="whose mix: the kinds its family takes, no more options than it does")
    load.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64], help="closed-loop client counts")
    load.add_argument("--seconds", type=float, default=30.0, help="seconds per client count")
    load.add_argument("--model", default=None, help="the model name to send (default: none, the served one)")
    load.add_argument("--kinds", nargs="+", default=list(KINDS), choices=ALL_KINDS,
                      help="request kinds in rotation (default: the seeds' mix; mp4: its video as a 10 s 720p "
                           "MPEG-4 file; text1: a text state with one question)")
    load.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                      help="seconds a client waits for an answer; past it the request counts as a timeout")
    load.add_argument("--processes", type=_positive_int, default=1,
                      help="generator processes to start with; doubled (up to --max-processes) while the "
                           "generator's ceiling against a stub server is below 3x the rate it measures")
    load.add_argument("--max-processes", type=_positive_int, default=None,
                      help="most generator processes (default: half the cores)")
    load.add_argument("--ceiling-seconds", type=float, default=5.0,
                      help="seconds of each measure of the generator's ceiling against its stub server")
    load.add_argument("--warm-up", type=float, default=5.0, metavar="SECONDS",
                      help="seconds of load, not measured, before each run at its client count (and each kind "
                           "of the mix once before a server's first): work done once per shape falls there; 0: none")
    load.add_argument("--published", choices=sorted(PUBLISHED), default=None,
                      help="the checkpoint size whose published figures (the seeds', MI300X) are printed beside "
                           "this run's")
    bench.set_defaults(func=cmd_bench)

    for name, func, text in (("ask", cmd_ask, "answer one request from a JSON file without a server and print "
                                               "the response"),
                             ("render", cmd_render, "show each question's prompt as the model reads it (text or "
                                                    "token ids); no model name needed")):
        cmd = sub.add_parser(name, help=text, parents=[common], formatter_class=formatter)
        _runtime_options(cmd)
        cmd.add_argument("--request", required=True, help="request JSON file, or - for stdin")
        cmd.set_defaults(func=func)
    render = cmd  # the last of the two
    render.add_argument("--format", choices=("text", "ids", "json"), default="text",
                        help="text: each question's prompt; ids: its token ids on one line; json: both, one line")
    return parser


@contextmanager
def _quiet_third_party() -> Iterator[None]:
    """torch, torchvision and transformers warn about their own internals during export; a user cannot act on
    them. Restored on the way out, so a caller in the same process (a test) keeps its own settings."""
    # TORCH_LOGS "-onnx": torch.onnx logs errors only (not "torchvision is not installed" four times per graph).
    quiet = {"TRANSFORMERS_VERBOSITY": "error", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "TORCH_LOGS": "-onnx",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    saved = {key: os.environ.get(key) for key in quiet}
    os.environ.update({key: os.environ.get(key) or value for key, value in quiet.items()})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.debug:
        return args.func(args)
    try:
        # The bench's report says which kernels the torch side ran: transformers' own warnings about that (a
        # kernel package falling back to torch) stay in sight.
        with nullcontext() if args.command == "bench" else _quiet_third_party():
            return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # every failure a user can cause ends here: one line, the cause named
        message = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, ModuleNotFoundError):
            message = missing_module_hint(exc.name, args.command) or message
        print(f"systemone {args.command}: error: {message} (--debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
