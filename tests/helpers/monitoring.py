"""The shipped monitoring as the tests read it: the committed Grafana dashboard and the pattern of the series its
queries (and the Prometheus rules) select, read by the monitoring e2e and the MTP demo's."""
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "qwen-vllm-ext.json"
SELECTOR = re.compile(r"(?<![\w:])((?:vllm:|qwen_ext_)[A-Za-z0-9_:]+)(\{[^}]*\})?")
