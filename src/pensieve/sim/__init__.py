"""The simulator: Pensieve's scheduler and tiered cache on virtual time, a calibrated step-cost
model standing in for the device (:mod:`pensieve.sim.simulator`, :mod:`pensieve.sim.step_cost`,
:mod:`pensieve.sim.transfer_model`, the disk tier's timing :mod:`pensieve.sim.disk`)."""
