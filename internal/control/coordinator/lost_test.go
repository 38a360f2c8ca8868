package coordinator_test

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"stasis/internal/control/coordinator"
	"stasis/internal/control/system"
	"stasis/internal/proc"
	"stasis/internal/providers/local"
	"stasis/internal/storage/store"
	"stasis/internal/testwait"
)

// stepClock is a clock whose timers fire only when the test says.
type stepClock struct {
	mu      sync.Mutex
	waiters []chan time.Time
}

func (c *stepClock) Now() time.Time { return time.Now() }

func (c *stepClock) After(time.Duration) <-chan time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := make(chan time.Time, 1)
	c.waiters = append(c.waiters, ch)
	return ch
}

// fire fires every timer set, and says how many there were.
func (c *stepClock) fire() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, ch := range c.waiters {
		ch <- time.Now()
	}
	n := len(c.waiters)
	c.waiters = nil
	return n
}

// An episode whose sandbox dies is marked lost as soon as that is
// noticed, not at the next server start: one by the wait on it, which
// finds its sandbox deleted, the other by the liveness check, run by the
// clock, which finds its sandbox's keeper killed. Neither is live any
// more, the store says lost, nothing of their sandboxes is left, and a
// verify says to restore them.
func TestLostWhenNoticed(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	clock := &stepClock{}
	w := newWorld(t, func(c *system.Config) {
		c.LivenessInterval = time.Minute
		c.CoordinatorOptions = func(o *coordinator.Options) { o.Clock = clock }
	})
	c := w.Coordinator
	for _, ep := range []string{"ep-w", "ep-t"} {
		h := w.Hold(ep, 2)
		if _, err := c.Start(ctx, ep, "sh-renext-spaces", "mini"); err != nil {
			t.Fatal(err)
		}
		waitHeld(t, ctx, h, "call 2 of "+ep)
	}
	lost := func(ep string) {
		t.Helper()
		if _, live := c.Live(ep); live {
			t.Fatalf("%s is still live", ep)
		}
		row, err := w.Store.GetEpisode(ctx, ep)
		if err != nil || row.State != store.EpisodeLost || row.Sandbox != "" {
			t.Fatalf("%s: %+v %v, want lost with no sandbox", ep, row, err)
		}
		if _, _, err := c.Verify(ctx, ep); err == nil || !strings.Contains(err.Error(), "restore it first") {
			t.Fatalf("verify of lost %s: %v", ep, err)
		}
	}

	// The wait finds the sandbox deleted.
	row, _ := w.Store.GetEpisode(ctx, "ep-w")
	if err := w.local.Delete(ctx, row.Sandbox); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Wait(ctx, "ep-w"); !errors.Is(err, coordinator.ErrLost) || !strings.Contains(err.Error(), "ep-w") {
		t.Fatalf("wait on an episode whose sandbox was deleted: %v", err)
	}
	lost("ep-w")

	// The liveness check finds the keeper killed.
	row, _ = w.Store.GetEpisode(ctx, "ep-t")
	info, err := w.local.Get(ctx, row.Sandbox)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Dir string `json:"dir"`
	}
	if err := json.Unmarshal(info.Descriptor, &d); err != nil {
		t.Fatal(err)
	}
	if n, err := local.Crash(filepath.Dir(filepath.Dir(filepath.Dir(d.Dir)))); err != nil || n != 1 {
		t.Fatalf("kill the sandbox: %d %v", n, err)
	}
	if _, live := c.Live("ep-t"); !live {
		t.Fatal("ep-t was dropped before anything checked it")
	}
	testwait.Until(t, "the liveness check to wait on the clock", time.Minute, func() bool { return clock.fire() > 0 })
	testwait.Until(t, "ep-t to be marked lost", time.Minute, func() bool {
		row, err := w.Store.GetEpisode(ctx, "ep-t")
		return err == nil && row.State == store.EpisodeLost
	})
	lost("ep-t")
	if infos, err := w.local.List(ctx, nil); err != nil || len(infos) != 0 {
		t.Fatalf("sandboxes left: %+v %v", infos, err)
	}
}

// An episode whose supervisor is killed (its sandbox runs on, but nothing
// answers in its session directory and no receipt was left) is marked
// lost by the liveness check, as one whose sandbox died: what is left of
// its sandbox is deleted, and a verify says to restore it. Before, it
// stayed live for ever, every status failing (the kill matrix's
// supervisor cells).
func TestLostWhenTheSupervisorIsKilled(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	clock := &stepClock{}
	w := newWorld(t, func(c *system.Config) {
		c.LivenessInterval = time.Minute
		c.CoordinatorOptions = func(o *coordinator.Options) { o.Clock = clock }
	})
	c := w.Coordinator
	const ep = "ep-s"
	h := w.Hold(ep, 2)
	if _, err := c.Start(ctx, ep, "sh-renext-spaces", "mini"); err != nil {
		t.Fatal(err)
	}
	waitHeld(t, ctx, h, "call 2 of "+ep)
	e, _ := c.Live(ep)
	st, err := e.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The supervisor, from the host: the process of the supervisor's
	// identity (its pid in the sandbox, its start time).
	pid := hostPIDOf(t, st.Identity.PID, st.Identity.StartTime)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the supervisor to be gone", time.Minute, func() bool {
		_, err := e.Status(ctx)
		return err != nil
	})
	testwait.Until(t, "the liveness check to wait on the clock", time.Minute, func() bool { return clock.fire() > 0 })
	testwait.Until(t, ep+" to be marked lost", time.Minute, func() bool {
		row, err := w.Store.GetEpisode(ctx, ep)
		return err == nil && row.State == store.EpisodeLost
	})
	if _, live := c.Live(ep); live {
		t.Fatalf("%s is still live", ep)
	}
	if row, _ := w.Store.GetEpisode(ctx, ep); row.Sandbox != "" {
		t.Fatalf("%s: %+v, want lost with no sandbox", ep, row)
	}
	if _, _, err := c.Verify(ctx, ep); err == nil || !strings.Contains(err.Error(), "restore it first") {
		t.Fatalf("verify of lost %s: %v", ep, err)
	}
	if infos, err := w.local.List(ctx, nil); err != nil || len(infos) != 0 {
		t.Fatalf("sandboxes left: %+v %v", infos, err)
	}
}

// hostPIDOf is the host pid of the process whose pid in its own pid
// namespace is nsPID and whose start time is start.
func hostPIDOf(t *testing.T, nsPID int, start uint64) int {
	t.Helper()
	all, err := proc.All()
	if err != nil {
		t.Fatal(err)
	}
	for pid, st := range all {
		if st.StartTime != start {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(b), "\n") {
			if rest, ok := strings.CutPrefix(l, "NSpid:"); ok {
				f := strings.Fields(rest)
				if len(f) > 0 && f[len(f)-1] == strconv.Itoa(nsPID) {
					return pid
				}
			}
		}
	}
	t.Fatalf("no process %d@%d on the host", nsPID, start)
	return 0
}
