import os
import sys

# tests/support holds the helper modules (models, cases, snapshot renderers); tests import
# them by name (`import numerics_cases`). Spawned ranks unpickle worker functions by that
# module name too: multiprocessing's spawn hands them this sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
