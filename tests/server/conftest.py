"""Server tests import their shared helpers (server_engine_settings, server_process) from this folder."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
