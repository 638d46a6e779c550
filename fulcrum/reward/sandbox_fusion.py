"""A client of a SandboxFusion service (https://github.com/bytedance/SandboxFusion), as verl calls it.

`run_code(url, code, stdin, timeout_s, memory_mb)` POSTs verl's request
`{"code", "stdin", "language": "python", "compile_timeout", "run_timeout", "memory_limit_MB", "files": {},
"fetch_files": []}` to the `run_code` endpoint and returns the run's stdout, whatever its exit status (the
code reward reads its verdict from it, as from the jail's), or None when the run went past `run_timeout`.
A failed request is retried on a gateway timeout (HTTP 504) up to three times, as verl does, and otherwise
raises SandboxError naming the URL.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

COMPILE_TIMEOUT_S = 10
EXTRA_REQUEST_S = 10
RETRIES = 3


class SandboxError(RuntimeError):
    """The SandboxFusion service could not be reached or answered something unreadable."""


def run_code(url: str, code: str, stdin: str, timeout_s: float, memory_mb: int) -> str | None:
    """The stdout of running `code` with `stdin` on the service at `url`; None past its time limit."""
    payload = json.dumps(
        {
            "compile_timeout": COMPILE_TIMEOUT_S,
            "run_timeout": timeout_s,
            "code": code,
            "stdin": stdin,
            "memory_limit_MB": memory_mb,
            "language": "python",
            "files": {},
            "fetch_files": [],
        }
    ).encode()
    request = urllib.request.Request(
        url, data=payload, headers={"Content-Type": "application/json", "Accept": "application/json"}
    )
    for attempt in range(RETRIES):
        try:
            with urllib.request.urlopen(
                request, timeout=COMPILE_TIMEOUT_S + timeout_s + EXTRA_REQUEST_S
            ) as r:
                answer = json.loads(r.read().decode())
            break
        except urllib.error.HTTPError as err:
            if err.code == 504 and attempt + 1 < RETRIES:
                time.sleep(1 + attempt)
                continue
            raise SandboxError(f"reward_model.sandbox_fusion.url={url}: HTTP {err.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise SandboxError(f"reward_model.sandbox_fusion.url={url}: {err}") from None
    run = answer.get("run_result") or {}
    if run.get("status") == "TimeLimitExceeded":
        return None
    return str(run.get("stdout") or "")
