import os
import sys

# tests/ holds helper models imported by spawned ranks by module name.
sys.path.insert(0, os.path.dirname(__file__))
