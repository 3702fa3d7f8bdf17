import sys
from pathlib import Path

# Tests import the package from this checkout, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
