"""Model selection for PyTorch Lightning by the Laplace marginal likelihood (Immer et al., ICML 2021)."""
from .callbacks import MargLikCallback, MargLikCheckpoint, MargLikEarlyStopping
from .curvature import CurvatureStatistics, collect_statistics
from .evidence import LaplaceEvidence
from .predictive import RegressionPrediction, linearized_outputs, predict_classification, predict_regression
from .selection import CandidateResult, NegativeLogLikelihood, select_models
from .hyperparameters import CategoricalLikelihood, GaussianLikelihood, GaussianPrior, Likelihood, map_loss

__all__ = [
    "CandidateResult",
    "CategoricalLikelihood",
    "CurvatureStatistics",
    "GaussianLikelihood",
    "GaussianPrior",
    "LaplaceEvidence",
    "MargLikCallback",
    "MargLikCheckpoint",
    "MargLikEarlyStopping",
    "NegativeLogLikelihood",
    "Likelihood",
    "collect_statistics",
    "linearized_outputs",
    "map_loss",
    "predict_classification",
    "predict_regression",
    "RegressionPrediction",
    "select_models",
]
__version__ = "0.1.0"
