"""`systemone`: export a checkpoint, serve an artifact, ask it one request, or show what it reads.

It sits above export/, runtime/ and server/ (it drives all three), so it lives in the top package."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from collections.abc import Callable
from typing import Any

from .runtime.session import DEVICES

API_KEY_ENV = "SYSTEMONE_API_KEY"


def _load_request(path: str) -> Any:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    return json.loads(text)


def _service(args: argparse.Namespace):
    from .runtime.artifact import Artifact
    from .runtime.media_allowance import MediaBudget
    from .runtime.media_fetch import FetchPolicy
    from .runtime.engine import EngineOptions
    from .runtime.service import DecisionService, MediaLimits

    policy = FetchPolicy(
        allowed_local_path=Path(args.allowed_local_media_path) if args.allowed_local_media_path else None,
        allowed_domains=frozenset(args.allowed_media_domains) if args.allowed_media_domains else None,
        allow_private_hosts=args.allow_private_media_hosts, max_bytes=args.max_media_bytes,
        image_timeout_s=args.image_fetch_timeout, video_timeout_s=args.video_fetch_timeout)
    options = EngineOptions(device=args.device, max_model_len=args.max_model_len, fetch_policy=policy)
    return DecisionService(Artifact.load(args.artifact), options, served_model_names=args.served_model_name or None,
                           media_limits=MediaLimits(args.limit_images, args.limit_videos),
                           media_workers=args.media_workers,
                           media_budget=MediaBudget(args.max_request_pixels, args.max_request_media_bytes,
                                                    args.max_video_frame_pixels, args.max_jpeg_video_frames))


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
    from .export.pipeline import export_checkpoint

    export_checkpoint(args.source, args.out, revision=args.revision, atol=args.atol, prob_atol=args.prob_atol,
                      overwrite=args.overwrite)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import os

    import uvicorn

    from .server.app import ServerOptions, create_app
    from .server.auth import is_loopback
    from .server.connections import AcceptFailureFilter, guarded_protocol, raise_descriptor_limit

    api_key = (args.api_key or os.environ.get(API_KEY_ENV) or "").strip() or None
    if api_key is None and not is_loopback(args.host) and not args.allow_unauthenticated:
        print(f"refusing to serve on {args.host} without an API key: set --api-key (or {API_KEY_ENV}), bind a "
              "loopback address, or pass --allow-unauthenticated", file=sys.stderr)
        return 2
    options = ServerOptions(api_key=api_key, max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                            request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes,
                            log_requests=args.log_requests, max_parse_bytes=args.max_parse_bytes)
    # uvicorn's "trace" is below DEBUG and unknown to logging.basicConfig
    level = 5 if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("asyncio").addFilter(AcceptFailureFilter())
    # Connections stay below the descriptor limit (model files, media sockets and logs need some too).
    max_connections = min(args.max_connections, max(16, raise_descriptor_limit() - 256))
    app = create_app(_service(args), options)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=int(args.request_timeout) + 5,
                http=guarded_protocol(args.header_timeout, max_connections), limit_concurrency=max_connections,
                timeout_keep_alive=5)
    return 0


def _print_result(args: argparse.Namespace, produce: Callable[[Any, Any], Any]) -> int:
    """Load the artifact and the request, print `produce(service, body)` as JSON (or the error body, exit 1)."""
    from .models.errors import DecisionError, SchemaError

    service = _service(args)
    try:
        result = produce(service, _load_request(args.request))
    except (DecisionError, SchemaError) as exc:
        return _print_error(exc)
    print(json.dumps(result, ensure_ascii=False, indent=2))
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    return _print_result(args, lambda service, body: service.decide(body))


def cmd_render(args: argparse.Namespace) -> int:
    def render(service, body) -> dict[str, Any]:
        return {"model": service.model_name, "questions": [
            {"id": p.question.id, "tokens": len(p.token_ids), "text": p.text, "token_ids": p.token_ids}
            for p in service.render(body)]}

    return _print_result(args, render)


def _runtime_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", help="an exported artifact directory")
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="execution provider; one that is absent is an error (default: auto)")
    parser.add_argument("--served-model-name", action="append", default=[],
                        help="name(s) the model answers to; the first is reported (default: the export source)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt in tokens (default: the model's positions); nothing is truncated")
    media = parser.add_argument_group("media fetching (safe by default)")
    media.add_argument("--allowed-local-media-path", default=None, help="directory file:// URLs may read from")
    media.add_argument("--allowed-media-domains", action="append", default=[],
                       help="only these hostnames (exact match) may be fetched; repeat for several")
    media.add_argument("--allow-private-media-hosts", action="store_true",
                       help="allow hosts that resolve to private, loopback or link-local addresses")
    media.add_argument("--max-media-bytes", type=int, default=256 << 20, help="largest media download (413 over)")
    media.add_argument("--limit-images", type=int, default=16, help="most images per request")
    media.add_argument("--limit-videos", type=int, default=4, help="most videos per request")
    media.add_argument("--image-fetch-timeout", type=float, default=5.0,
                       help="seconds a whole image fetch may take (connect, headers, body; 422 after)")
    media.add_argument("--video-fetch-timeout", type=float, default=30.0, help="the same for a video")
    media.add_argument("--media-workers", type=int, default=8,
                       help="threads that fetch, decode and preprocess media, shared by all requests")
    media.add_argument("--max-request-pixels", type=int, default=70_000_000,
                       help="decoded pixels of one request's images and sampled video frames, from their headers")
    media.add_argument("--max-request-media-bytes", type=int, default=256 << 20,
                       help="bytes one request's media URLs may download in all")
    media.add_argument("--max-video-frame-pixels", type=int, default=3840 * 2160, help="largest video frame")
    media.add_argument("--max-jpeg-video-frames", type=int, default=64, help="most frames of a data:video/jpeg")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="systemone", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    export = sub.add_parser("export", help="checkpoint (directory or hub id) -> ONNX artifact")
    export.add_argument("source")
    export.add_argument("--out", required=True)
    export.add_argument("--revision", default=None, help="hub revision")
    export.add_argument("--atol", type=float, default=2e-3, help="max |code logit diff| vs torch")
    export.add_argument("--prob-atol", type=float, default=1e-4, help="max |probability diff| vs torch")
    export.add_argument("--overwrite", action="store_true")
    export.set_defaults(func=cmd_export)

    serve = sub.add_parser("serve", help="serve POST /v1/systemone")
    _runtime_options(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help=f"require Authorization: Bearer KEY (or set {API_KEY_ENV}); without one the header is "
                            "ignored")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="serve on a non-loopback address without an API key")
    serve.add_argument("--max-concurrency", type=int, default=1, help="requests running inference at once")
    serve.add_argument("--max-queue", type=int, default=16, help="requests waiting for a slot; more get 503")
    serve.add_argument("--request-timeout", type=float, default=60.0, help="seconds a request may take (503 after)")
    serve.add_argument("--max-body-bytes", type=int, default=64 << 20,
                       help="largest request body, compressed or decompressed (413 over it)")
    serve.add_argument("--log-requests", action="store_true", help="log request bodies (they hold the state)")
    serve.add_argument("--max-parse-bytes", type=int, default=64 << 20,
                       help="bytes of request bodies parsed and checked at once (503 + Retry-After past it)")
    serve.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a connection may take to send a request's headers (then it is closed)")
    serve.add_argument("--max-connections", type=int, default=1024,
                       help="open connections; more are closed at once (and kept below the descriptor limit)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug",
                                                                "trace"])
    serve.set_defaults(func=cmd_serve)

    for name, func, text in (("ask", cmd_ask, "answer one request and print the response"),
                             ("render", cmd_render, "print each question's prompt text and token ids")):
        cmd = sub.add_parser(name, help=text)
        _runtime_options(cmd)
        cmd.add_argument("--request", required=True, help="request JSON file, or - for stdin")
        cmd.set_defaults(func=func)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
