import time
from netgrid import Load

def test_smoke(make_grid):
    with make_grid() as grid:
        with Load(grid, "a", workers=2) as load:
            time.sleep(3)
        print(load.served_by(0), load.wrong()[:3], len(load.outcomes))
        print(grid.candidates("a"))
