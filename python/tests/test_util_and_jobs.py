"""ActorPool, and JobSubmissionClient against the local cluster's job API."""

import time

import pytest

import regatta
from regatta.job_submission import JobStatus, JobSubmissionClient
from regatta.util import ActorPool


@regatta.remote
class Doubler:
    def __init__(self):
        self.calls = 0

    def double(self, x, pause=0.0):
        time.sleep(pause)
        self.calls += 1
        return 2 * x

    def count(self):
        return self.calls


def test_an_actor_pool_maps_in_order_and_unordered_over_all_its_actors():
    actors = [Doubler.remote() for _ in range(3)]
    pool = ActorPool(actors)
    assert list(pool.map(lambda a, v: a.double.remote(v), range(12))) == [2 * v for v in range(12)]
    # Slow first values finish last when taken unordered.
    unordered = list(pool.map_unordered(lambda a, v: a.double.remote(v, 0.5 if v == 0 else 0.0), range(6)))
    assert sorted(unordered) == [0, 2, 4, 6, 8, 10] and unordered[-1] == 0
    counts = regatta.get([a.count.remote() for a in actors])
    assert sum(counts) == 18 and all(c > 0 for c in counts), counts
    with pytest.raises(ValueError):
        ActorPool([])


def test_the_job_client_submits_follows_stops_and_deletes():
    client = JobSubmissionClient(regatta._current().cluster.job_address,
                                 token=regatta._current().cluster.token)
    job = client.submit_job(entrypoint="for i in 1 2 3; do echo line $i; sleep 0.2; done",
                            metadata={"team": "ml"}, runtime_env={"env_vars": {"A": "1"}})
    tailed = "".join(client.tail_job_logs_sync(job))
    assert tailed == "line 1\nline 2\nline 3\n"
    info = client.get_job_info(job)
    assert info.status == JobStatus.SUCCEEDED and info.metadata == {"team": "ml"} and info.driver_exit_code == 0
    assert client.get_job_logs(job) == tailed
    long = client.submit_job(entrypoint="sleep 60", submission_id="py-long")
    deadline = time.time() + 30
    while client.get_job_status(long) != JobStatus.RUNNING and time.time() < deadline:
        time.sleep(0.1)
    assert {j.submission_id for j in client.list_jobs()} >= {job, "py-long"}
    assert client.stop_job(long) is True
    while not client.get_job_status(long).is_terminal() and time.time() < deadline:
        time.sleep(0.1)
    assert client.get_job_status(long) == JobStatus.STOPPED
    assert client.delete_job(job) is True
    with pytest.raises(regatta.RegattaError, match="404"):
        client.get_job_info(job)
    address = regatta._current().cluster.job_address
    with pytest.raises(regatta.RegattaError, match="401"):
        JobSubmissionClient(address, token="not-the-token", verify=False)
    # A token the head does not know gets no authority: refused before the token is sent.
    with pytest.raises(ConnectionError, match="does not vouch for its authority"):
        JobSubmissionClient(address, token="abcdef." + "0" * 32)
    with pytest.raises(ConnectionError, match="join token"):
        JobSubmissionClient(address, token="not-the-token")


def test_placement_groups_reserve_place_and_release():
    from regatta.util import PlacementGroupSchedulingStrategy, placement_group, remove_placement_group

    group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    assert regatta.get(group.ready(), timeout=60) is True
    assert regatta.available_resources().get("CPU", 0.0) == 0.0, "the bundles hold both CPUs"
    placed = [Doubler.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
              for i in range(2)]
    assert regatta.get([a.double.remote(i) for i, a in enumerate(placed)], timeout=60) == [0, 2]
    # A second group does not fit while the first holds the CPUs.
    waiting = placement_group([{"CPU": 2}])
    assert waiting.wait(0.5) is False
    remove_placement_group(group)
    with pytest.raises(regatta.ActorDiedError) as caught:
        regatta.get(placed[0].double.remote(1), timeout=60)
    assert caught.value.cause == "group_removed", str(caught.value)
    assert waiting.wait(30) is True, "the freed CPUs go to the waiting group"
    remove_placement_group(waiting)
    with pytest.raises(regatta.InfeasibleError, match="GPU"):
        placement_group([{"GPU": 1}])
    with pytest.raises(ValueError, match="bundle index"):
        PlacementGroupSchedulingStrategy(waiting, 3)
    with pytest.raises(ValueError, match="strategy"):
        placement_group([{"CPU": 1}], strategy="NEAR")


def test_what_an_actor_prints_is_its_log_on_the_dashboard():
    import json
    import ssl
    import urllib.request

    @regatta.remote
    class Talker:
        def say(self, text):
            print(text, flush=True)
            return True

    talker = Talker.remote()
    assert regatta.get(talker.say.remote("hello from a python actor"), timeout=60)
    cluster = regatta._current().cluster
    request = urllib.request.Request(f"{cluster.job_address}/api/actors/{talker._actor_id}/logs",
                                     headers={"Authorization": f"Bearer {cluster.token}"})
    deadline, lines = time.time() + 15, []
    while time.time() < deadline:
        with urllib.request.urlopen(request, context=ssl._create_unverified_context()) as response:
            lines = [line["text"] for line in json.loads(response.read())["lines"]]
        if "hello from a python actor" in lines:
            break
        time.sleep(0.2)
    assert "hello from a python actor" in lines, lines
