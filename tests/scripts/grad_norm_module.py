"""A LightningModule that logs gradient norms with Lightning's own utility, as its documentation shows."""

import lightning as L
from lightning.pytorch.utilities import grad_norm


class LoggingGradNorm(L.LightningModule):
    def on_before_optimizer_step(self, optimizer):  # noqa: ANN001, ANN201
        self.log_dict(grad_norm(self, norm_type=2))
