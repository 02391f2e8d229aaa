"""Model selection for PyTorch Lightning by the Laplace marginal likelihood (Immer et al., ICML 2021)."""
from .bounds import BoundOptimizer, EvidenceBound
from .callbacks import MargLikBoundCallback, MargLikCallback, MargLikCheckpoint, MargLikConfigurationError, MargLikEarlyStopping
from .curvature import CurvatureOptions, CurvatureStatistics, collect_statistics
from .curvature.layers import KronShape, KronSums, LayerRule, register_layer_rule
from .curvature.structures import register_structure
from .denormals import DenormalFlush
from .diagnostics import ef_curvature_ratio
from .evidence import LaplaceEvidence
from .modules import FixupBias, FixupScale
from .predictive import RegressionPrediction, linearized_outputs, predict, predict_classification, predict_regression
from .selection import CandidateResult, NegativeLogLikelihood, select_models
from .hyperparameters import (
    CategoricalLikelihood,
    GammaHyperprior,
    GaussianLikelihood,
    GaussianPrior,
    Hyperprior,
    Likelihood,
    LogNormalHyperprior,
    assign_hyperparameters,
    map_loss,
    no_decay_names,
)
from .solvers import Solution

__all__ = [
    "BoundOptimizer",
    "CandidateResult",
    "CategoricalLikelihood",
    "CurvatureOptions",
    "CurvatureStatistics",
    "DenormalFlush",
    "GammaHyperprior",
    "GaussianLikelihood",
    "GaussianPrior",
    "Hyperprior",
    "KronShape",
    "KronSums",
    "EvidenceBound",
    "FixupBias",
    "FixupScale",
    "LaplaceEvidence",
    "LayerRule",
    "LogNormalHyperprior",
    "MargLikBoundCallback",
    "MargLikCallback",
    "MargLikCheckpoint",
    "MargLikConfigurationError",
    "MargLikEarlyStopping",
    "NegativeLogLikelihood",
    "Likelihood",
    "Solution",
    "assign_hyperparameters",
    "collect_statistics",
    "ef_curvature_ratio",
    "linearized_outputs",
    "map_loss",
    "no_decay_names",
    "predict",
    "predict_classification",
    "predict_regression",
    "RegressionPrediction",
    "register_layer_rule",
    "register_structure",
    "select_models",
]
__version__ = "0.1.0"
