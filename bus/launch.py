"""``python -m bus.launch COMPONENT CONFIG_JSON``: run one component as this process."""
from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from bus.component import run
from components import service_class
from schemas.config import WeirConfig


def main(argv: list[str]) -> None:
    name, config_path = argv
    config = msgspec.json.decode(Path(config_path).read_bytes(), type=WeirConfig)
    run(service_class(name), config)


if __name__ == "__main__":
    main(sys.argv[1:])
