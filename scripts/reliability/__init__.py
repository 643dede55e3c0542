"""Reliability checks against a live engine: ``soak`` (RSS and fds over waves of requests),
``fuzz_bus`` (hostile frames on every bus socket) and ``fuzz_http`` (hostile HTTP requests at
a gateway). Short seeded runs of both fuzzers are in tests/e2e."""
