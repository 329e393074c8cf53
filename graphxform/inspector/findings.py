"""What a static check found: findings that name nodes, grouped by check."""

from __future__ import annotations

import dataclasses

ERROR, WARNING, INFO = "error", "warning", "info"
NODES_SHOWN = 6  # a finding's text names at most this many nodes (JSON has them all)


@dataclasses.dataclass
class Finding:
    level: str
    check: str
    message: str
    nodes: list = dataclasses.field(default_factory=list)

    def text(self) -> str:
        shown = ", ".join(self.nodes[:NODES_SHOWN])
        more = f" and {len(self.nodes) - NODES_SHOWN} more" if len(self.nodes) > NODES_SHOWN \
            else ""
        return f"{self.level}: {self.message}" + (f" [{shown}{more}]" if shown else "")


@dataclasses.dataclass
class CheckResult:
    """One check's findings and a one-line summary of what it looked at."""
    name: str
    summary: str = ""
    findings: list = dataclasses.field(default_factory=list)
    ran: bool = True  # False: nothing to check in this graph (no collectives, no accumulators)

    def add(self, level: str, message: str, nodes=()) -> None:
        self.findings.append(Finding(level, self.name, message, sorted(set(nodes))))

    def error(self, message: str, nodes=()) -> None:
        self.add(ERROR, message, nodes)

    def warning(self, message: str, nodes=()) -> None:
        self.add(WARNING, message, nodes)

    def info(self, message: str, nodes=()) -> None:
        self.add(INFO, message, nodes)

    @property
    def status(self) -> str:
        if not self.ran:
            return "-"
        levels = {f.level for f in self.findings}
        return ERROR if ERROR in levels else WARNING if WARNING in levels else "ok"
