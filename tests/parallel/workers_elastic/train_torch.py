"""Elastic training worker (issue 26): a linear model trained with ``lcc.elastic.run`` (as
``hvd.elastic.run``), TorchState and ElasticSampler; launch rank VICTIM kills itself with SIGKILL at epoch 0, step
KILL_AT (before its backward). Commits every COMMIT steps and at each epoch's end. Rank 0
of the final group saves the parameters to OUT (.pt), and prints when the first step on the
new group finished (FIRST_STEP <unix time>); the victim prints KILL <unix time> before dying.

With GROW_AT, rank 0 rewrites the host list that lccrun's discovery script prints
($LCC_TEST_HOSTS_FILE) to NEW_HOSTS at epoch 0, step GROW_AT, and every rank waits 3 s there
so that lccrun publishes it before the next commit. The victim creates the file
$LCC_TEST_KILL_MARK (when set) just before it dies. Rank 0 prints RESET <epoch> <batch> <size>
after each reset (where training goes on from).

With LCC_TEST_SECOND_KILL=N:E:B the process with launch number N (a replacement that joined:
``launch_number()``) kills itself the same way at epoch E, step B; with N:E:B:raise it raises
RuntimeError there instead.

Usage: train_torch.py OUT VICTIM KILL_AT [GROW_AT NEW_HOSTS]   (VICTIM -1: nobody dies)
"""
import os
import sys
import time

import torch
from problem import BATCH, COMMIT, DIM, EPOCHS, LR, MOMENTUM, SEED, N, data

import lightcc.torch as lcc
from lightcc.common.elastic import launch_number


def main() -> None:
    out, victim, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    grow_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    second = os.environ.get("LCC_TEST_SECOND_KILL", "-1:-1:-1").split(":")
    raises = second[3:] == ["raise"]
    second = [int(v) for v in second[:3]]
    lcc.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(DIM, 1)
    if lcc.rank() != 0:            # different on purpose: state.sync() must overwrite it
        torch.nn.init.normal_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    opt = lcc.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    x, y = data()
    sampler = lcc.elastic.ElasticSampler(range(N), shuffle=True, seed=SEED)
    state = lcc.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0)
    resets = []

    def on_reset():
        resets.append(time.time())
        if lcc.rank() == 0:
            print(f"RESET {state.epoch} {state.batch} {lcc.size()}", flush=True)

    state.register_reset_callbacks([on_reset])
    reported = []

    @lcc.elastic.run
    def train(state):
        while state.epoch < EPOCHS:
            mine = list(state.sampler)
            for i in range(0, len(mine), BATCH):
                again = [launch_number(), state.epoch, state.batch] == second
                if again and raises:
                    raise RuntimeError(f"launch number {launch_number()} fails")
                if again or (launch_number() == victim and state.epoch == 0
                             and state.batch == kill_at):
                    print(f"KILL {time.time():.6f}", flush=True)
                    if os.environ.get("LCC_TEST_KILL_MARK"):
                        open(os.environ["LCC_TEST_KILL_MARK"], "w").close()
                    os.kill(os.getpid(), 9)
                if state.epoch == 0 and state.batch == grow_at:
                    if lcc.rank() == 0:
                        with open(os.environ["LCC_TEST_HOSTS_FILE"], "w") as f:
                            f.write(sys.argv[5].replace(",", "\n") + "\n")
                    time.sleep(3)
                idx = mine[i:i + BATCH]
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(state.model(x[idx]), y[idx])
                loss.backward()
                opt.step()
                if resets and not reported and lcc.rank() == 0:
                    reported.append(1)
                    print(f"FIRST_STEP {time.time():.6f} size {lcc.size()}", flush=True)
                state.batch += 1
                state.sampler.record_batch(i // BATCH, BATCH)
                if state.batch % COMMIT == 0:
                    state.commit()
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if lcc.rank() == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
        print(f"DONE size {lcc.size()} resets {len(resets)}", flush=True)


if __name__ == "__main__":
    main()
