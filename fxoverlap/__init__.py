"""fxoverlap: FX graph passes that overlap expert-parallel all-to-all with compute."""

from fxoverlap.backend import enable_dynamic_output_shapes
from fxoverlap.config import ConfigError, OverlapConfig, UnknownConfigField
from fxoverlap.ir.errors import FxOverlapError
from fxoverlap.dispatch_ops import DispatchOverflow
from fxoverlap.engine import Engine, InputError, MicrobatchMismatch, optimize
from fxoverlap.expert_parallel import expert_parallel
from fxoverlap.fp8_ops import Fp8ExpertError, Fp8Unavailable
from fxoverlap.inputs import EPGroupError
from fxoverlap.program_key import ProgramKey, RepeatedRecompileWarning, UnsupportedModelState
from fxoverlap.region import region
from fxoverlap.pipeline_parallel import pipeline_schedule
from fxoverlap.runtime import StageFailed
from fxoverlap.ir.stage import Direction, Stage, StageKind, StreamKind
# (after this, fxoverlap.tune is the function; the module's other names: from fxoverlap.tune import ...)
from fxoverlap.tune import CandidateMismatch, TuneSkipped, TuneWarning, tune, tune_with_report

__all__ = ["ConfigError", "DispatchOverflow", "FxOverlapError", "Engine", "EPGroupError", "enable_dynamic_output_shapes", "InputError", "MicrobatchMismatch", "optimize", "pipeline_schedule", "expert_parallel", "Fp8ExpertError", "Fp8Unavailable", "OverlapConfig", "ProgramKey", "region", "RepeatedRecompileWarning", "StageFailed", "UnknownConfigField", "UnsupportedModelState", "Direction", "Stage", "StageKind", "StreamKind",
           "tune", "tune_with_report", "CandidateMismatch", "TuneSkipped", "TuneWarning"]
__version__ = "0.1.0"
# The torch.compile backend is found through the torch_dynamo_backends entry point (setup.cfg):
# importing fxoverlap registers nothing and changes no Dynamo setting.
