"""Prometheus metrics, in the text exposition format: requests by status, latency, queue depth, tokens."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.buckets = [0] * len(LATENCY_BUCKETS)
        self.latency_count = 0
        self.latency_sum = 0.0
        self.input_tokens = 0
        self.questions = 0
        self.aborted_uploads = 0

    def observe(self, status: int, seconds: float, input_tokens: int = 0, questions: int = 0) -> None:
        with self._lock:
            self.requests[str(status)] += 1
            self.latency_count += 1
            self.latency_sum += seconds
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self.buckets[i] += 1
            self.input_tokens += input_tokens
            self.questions += questions

    def client_aborted_upload(self) -> None:
        with self._lock:
            self.aborted_uploads += 1

    def render(self, running: int, queued: int, media_running: int = 0,
               lanes: Mapping[str, tuple[float, int]] | None = None, media_load_s: float = 0.0,
               media_fallbacks: int = 0, media_process_jobs: int = 0) -> str:
        """`lanes`: the scheduler's work, seconds and jobs by lane; `media_load_s`: the media pool's seconds;
        `media_process_jobs`: pixel jobs run in the media worker processes; `media_fallbacks`: pixel jobs run in
        threads because shared memory was full or a worker process died."""
        with self._lock:
            lines = ["# HELP systemone_requests_total POST /v1/systemone requests by HTTP status.",
                     "# TYPE systemone_requests_total counter"]
            lines += [f'systemone_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
            lines += ["# HELP systemone_request_seconds Time from request to response.",
                      "# TYPE systemone_request_seconds histogram"]
            lines += [f'systemone_request_seconds_bucket{{le="{b}"}} {n}' for b, n in zip(LATENCY_BUCKETS,
                                                                                        self.buckets)]
            lines += [f'systemone_request_seconds_bucket{{le="+Inf"}} {self.latency_count}',
                      f"systemone_request_seconds_sum {self.latency_sum}",
                      f"systemone_request_seconds_count {self.latency_count}",
                      "# HELP systemone_requests_running Requests running inference now.",
                      "# TYPE systemone_requests_running gauge", f"systemone_requests_running {running}",
                      "# HELP systemone_queue_depth Requests waiting for an inference slot.",
                      "# TYPE systemone_queue_depth gauge", f"systemone_queue_depth {queued}",
                      "# HELP systemone_input_tokens_total Prompt tokens read (usage.input_tokens).",
                      "# TYPE systemone_input_tokens_total counter", f"systemone_input_tokens_total {self.input_tokens}",
                      "# HELP systemone_questions_total Questions answered.",
                      "# TYPE systemone_questions_total counter", f"systemone_questions_total {self.questions}",
                      "# HELP systemone_client_aborted_uploads_total Clients that went away while sending the body.",
                      "# TYPE systemone_client_aborted_uploads_total counter",
                      f"systemone_client_aborted_uploads_total {self.aborted_uploads}",
                      "# HELP systemone_media_jobs_running Media inputs being fetched, decoded or preprocessed now.",
                      "# TYPE systemone_media_jobs_running gauge", f"systemone_media_jobs_running {media_running}",
                      "# HELP systemone_media_load_seconds_total Seconds media threads spent loading, all together.",
                      "# TYPE systemone_media_load_seconds_total counter",
                      f"systemone_media_load_seconds_total {media_load_s}",
                      "# HELP systemone_media_process_jobs_total Media pixel jobs run in the media worker "
                      "processes.",
                      "# TYPE systemone_media_process_jobs_total counter",
                      f"systemone_media_process_jobs_total {media_process_jobs}",
                      "# HELP systemone_media_fallback_jobs_total Media pixel jobs run in the server's threads "
                      "because shared memory was full or a media worker process died.",
                      "# TYPE systemone_media_fallback_jobs_total counter",
                      f"systemone_media_fallback_jobs_total {media_fallbacks}",
                      "# HELP systemone_engine_busy_seconds_total Seconds the scheduler's lanes spent running graphs "
                      "(text: the engine thread; media: the vision lane).",
                      "# TYPE systemone_engine_busy_seconds_total counter"]
            lines += [f'systemone_engine_busy_seconds_total{{lane="{lane}"}} {seconds}'
                      for lane, (seconds, _) in sorted((lanes or {}).items())]
            lines += ["# HELP systemone_engine_jobs_total Jobs (graph calls or vision batches) each lane ran.",
                      "# TYPE systemone_engine_jobs_total counter"]
            lines += [f'systemone_engine_jobs_total{{lane="{lane}"}} {jobs}'
                      for lane, (_, jobs) in sorted((lanes or {}).items())]
        return "\n".join(lines) + "\n"
