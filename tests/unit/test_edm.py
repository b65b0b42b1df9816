"""dpipe.diffusion.edm against diffusers' EDMEulerScheduler and EDM's weighted loss."""

import torch
from diffusers import EDMEulerScheduler

from dpipe.diffusion.edm import (Preconditioning, SIGMA_MAX, SIGMA_MIN, noisy_input_and_target,
                                 sigma_of_t, t_of_sigma)

SIGMA_DATA = 0.5


def test_preconditioning_is_the_schedulers():
    scheduler = EDMEulerScheduler(sigma_data=SIGMA_DATA, prediction_type="epsilon")
    sigma = torch.tensor([0.01, 0.3, 1.0, 7.0, 80.0])
    p = Preconditioning(sigma.double(), SIGMA_DATA)
    x, out = torch.randn(5, 4, 3), torch.randn(5, 4, 3)
    for i, s in enumerate(sigma):
        torch.testing.assert_close(p.c_in[i].float(), scheduler._get_conditioning_c_in(s))
        torch.testing.assert_close(p.c_noise[i].float(), scheduler.precondition_noise(s))
        torch.testing.assert_close(p.denoised(x, out)[i].float(),
                                   scheduler.precondition_outputs(x[i], out[i], s))


def test_the_plain_loss_on_the_target_is_edms_weighted_loss():
    """lambda(sigma) |D(x) - x0|^2 == |F - target|^2 for any output F."""
    torch.manual_seed(0)
    x0, noise, out = torch.randn(3, 2, 5).double(), torch.randn(3, 2, 5).double(), torch.randn(3, 2, 5).double()
    sigma = torch.tensor([0.05, 1.0, 30.0]).double()
    scaled, target = noisy_input_and_target(x0, noise, sigma, SIGMA_DATA)
    p = Preconditioning(sigma, SIGMA_DATA)
    x = x0 + sigma.view(-1, 1, 1) * noise
    torch.testing.assert_close(scaled, p.c_in.view(-1, 1, 1) * x)
    edm = p.loss_weight().view(-1, 1, 1) * (p.denoised(x, out) - x0) ** 2
    torch.testing.assert_close((out - target) ** 2, edm)
    # The target is what the network must output for D to return x0 exactly.
    torch.testing.assert_close(p.denoised(x, target), x0)


def test_sigma_of_t_is_log_normal_under_logit_normal_t_and_clamped():
    z = torch.linspace(-3, 3, 7).double()
    torch.testing.assert_close(sigma_of_t(torch.sigmoid(z)).log(), z)
    torch.testing.assert_close(sigma_of_t(t_of_sigma(torch.tensor(7.25))), torch.tensor(7.25).double())
    assert float(sigma_of_t(torch.tensor(0.0))) == SIGMA_MIN
    assert float(sigma_of_t(torch.tensor(1.0))) == SIGMA_MAX
