"""The ``/metrics`` text: the workers' shared counters and the frontend's own, in the
Prometheus text exposition format.

Chapter 15 tells the story; chapter 16 adds the frontend's lifecycle counters (replies held,
failures, slow readers).
"""

from __future__ import annotations

from collections.abc import Mapping

from minisgl.server.frontend import RequestRouter

# Worker counter name -> (metric, Prometheus type, help).
WORKER_METRICS: dict[str, tuple[str, str, str]] = {
    "running": ("minisgl_running_requests", "gauge", "Requests in the running batch."),
    "waiting": ("minisgl_waiting_requests", "gauge", "Requests waiting to be admitted."),
    "kv_pages_in_use": ("minisgl_kv_pages_in_use", "gauge",
                        "KV pages held by requests (not counting the prefix cache)."),
    "prompt_tokens": ("minisgl_prompt_tokens_total", "counter", "Prompt tokens admitted."),
    "generation_tokens": ("minisgl_generation_tokens_total", "counter", "Tokens generated."),
    # chapter 23: with --speculative, the guesses made and those the target kept
    "spec_proposed_tokens": ("minisgl_spec_proposed_tokens_total", "counter",
                             "Tokens guessed by speculative decoding."),
    "spec_accepted_tokens": ("minisgl_spec_accepted_tokens_total", "counter",
                             "Guessed tokens the target model kept."),
    "live_states": ("minisgl_detokenizer_live_states", "gauge",
                    "Requests the detokenizer holds text state for."),
}


def metrics_text(worker_counters: Mapping[str, int], frontend: RequestRouter) -> str:
    """The Prometheus text exposition of the workers' counters and the frontend's."""
    rows = [(*WORKER_METRICS.get(name, (f"minisgl_{name}", "gauge", name)), value)
            for name, value in worker_counters.items()]
    rows += [
        ("minisgl_frontend_live_requests", "gauge",
         "Requests the API server waits on.", frontend.num_live),
        ("minisgl_frontend_requests_total", "counter",
         "Requests sent to the workers.", frontend.stats.submitted),
        ("minisgl_frontend_finished_total", "counter",
         "Requests answered to the end.", frontend.stats.finished),
        ("minisgl_frontend_aborted_total", "counter",
         "Requests aborted because their client went away.", frontend.stats.aborted),
        # Ending every request (chapter 16): replies held, failures, slow readers.
        ("minisgl_frontend_buffered_replies", "gauge",
         "Replies received and not yet taken by their reader.", frontend.num_buffered),
        ("minisgl_frontend_failed_total", "counter",
         "Requests that ended with an error.", frontend.stats.failed),
        ("minisgl_frontend_slow_readers_total", "counter",
         "Requests cut off because their client read too slowly.",
         frontend.stats.slow_readers),
    ]
    lines = []
    for name, kind, help_text, value in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"
