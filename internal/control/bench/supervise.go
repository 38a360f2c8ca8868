// Package bench measures stasis's own speed and memory: the figures that
// BENCHMARKS.md records and `stasis bench` prints. Each measurement comes
// with a baseline taken in the same run, so results are read as ratios on a
// shared, noisy machine.
package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"stasis/internal/insandbox/supervisor"
	"stasis/internal/proc"
)

// SuperviseOptions configure Supervise.
type SuperviseOptions struct {
	Exe        string   // the stasis binary
	Env        []string // extra environment for it
	Sizes      []int    // harness tree sizes, in processes
	Modes      []supervisor.Mode
	Iterations int    // pause/continue cycles per mode and size
	Dir        string // where session directories go (default: a new temporary directory)
	Progress   io.Writer
}

// Latency summarises a sample of durations.
type Latency struct {
	P50 time.Duration `json:"p50_ns"`
	P99 time.Duration `json:"p99_ns"`
	Max time.Duration `json:"max_ns"`
}

func summarise(d []time.Duration) Latency {
	if len(d) == 0 {
		return Latency{}
	}
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	at := func(q float64) time.Duration {
		i := int(q*float64(len(s))+0.5) - 1
		if i < 0 {
			i = 0
		}
		if i >= len(s) {
			i = len(s) - 1
		}
		return s[i]
	}
	return Latency{P50: at(0.50), P99: at(0.99), Max: s[len(s)-1]}
}

// SuperviseRow is one (mode, tree size) measurement.
type SuperviseRow struct {
	Mode       supervisor.Mode `json:"mode"`
	Procs      int             `json:"procs"`
	Iterations int             `json:"iterations"`
	Pause      Latency         `json:"pause"`    // round trip of `pause N` as a host sees it
	Continue   Latency         `json:"continue"` // round trip of `continue N`
	// Baseline is the round trip of `status` on the same socket in the same
	// run: the cost of asking at all.
	Baseline Latency `json:"baseline_status"`
	// Kernel is, for stop mode, SIGSTOP to an identical tree and polling
	// /proc until all stopped, done directly by the benchmark process with
	// no supervisor: the floor a stop pause can reach.
	Kernel      *Latency `json:"kernel_stop,omitempty"`
	Unconfirmed int      `json:"unconfirmed"`
	PeakRSSKiB  int64    `json:"supervisor_peak_rss_kib"`
	ShimRSSKiB  int64    `json:"shim_peak_rss_kib"`
}

// treeScript makes a harness tree of $1 processes: a shell that starts
// $1-1 sleeps and then becomes a sleep itself.
const treeScript = `i=1; while [ "$i" -lt "$1" ]; do sleep 3600 & i=$((i+1)); done; exec sleep 3600`

// Supervise measures pause and continue acknowledgement latency for each
// mode and tree size, and the supervisor's peak RSS.
func Supervise(ctx context.Context, o SuperviseOptions) ([]SuperviseRow, error) {
	if o.Iterations <= 0 {
		o.Iterations = 200
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	base, remove, err := dirOr(o.Dir, "stasis-bench-")
	if err != nil {
		return nil, err
	}
	defer remove()
	var rows []SuperviseRow
	for _, n := range o.Sizes {
		if n < 1 {
			return nil, fmt.Errorf("tree size %d: must be at least 1", n)
		}
		for _, mode := range o.Modes {
			fmt.Fprintf(o.Progress, "supervise: %s mode, %d processes, %d cycles ...\n", mode, n, o.Iterations)
			row, err := superviseOne(ctx, o, filepath.Join(base, fmt.Sprintf("%s-%d", mode, n)), mode, n)
			if err != nil {
				return rows, fmt.Errorf("%s mode, %d processes: %w", mode, n, err)
			}
			rows = append(rows, row)
		}
	}
	return rows, nil
}

func superviseOne(ctx context.Context, o SuperviseOptions, dir string, mode supervisor.Mode, n int) (SuperviseRow, error) {
	row := SuperviseRow{Mode: mode, Procs: n, Iterations: o.Iterations}
	c, err := supervisor.Spawn(ctx, supervisor.SpawnOptions{
		Exe: o.Exe, Env: o.Env, Dir: dir,
		Flags: []string{"--mode", string(mode), "--log-level", "error", "--grace", "1s"},
		Argv:  []string{"/bin/sh", "-c", treeScript, "bench-harness", strconv.Itoa(n)},
	})
	if err != nil {
		return row, err
	}
	defer func() {
		if _, err := c.Stop(ctx, 30*time.Second); err != nil {
			c.Kill()
		}
	}()
	spid := c.Cmd.Process.Pid
	if err := waitTree(spid, n+1, 30*time.Second); err != nil { // +1: the shim
		return row, err
	}
	var pauses, conts, base []time.Duration
	for i := 1; i <= o.Iterations; i++ {
		t0 := time.Now()
		if _, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpStatus}); err != nil {
			return row, err
		}
		base = append(base, time.Since(t0))
		t0 = time.Now()
		r, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpPause, Seq: int64(i)})
		if err != nil {
			return row, err
		}
		pauses = append(pauses, time.Since(t0))
		if !r.Ack.Confirmed {
			row.Unconfirmed++
		}
		// A hold's acknowledgement file is written after its reply; in a
		// checkpoint the snapshot comes between, so let it land (untimed)
		// rather than have the next request pay for it.
		if err := waitAckFile(dir, int64(i), supervisor.OpPause); err != nil {
			return row, err
		}
		t0 = time.Now()
		if _, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpContinue, Seq: int64(i)}); err != nil {
			return row, err
		}
		conts = append(conts, time.Since(t0))
		if err := waitAckFile(dir, int64(i), supervisor.OpContinue); err != nil {
			return row, err
		}
		if !r.Ack.Confirmed { // the tree was relaunched: wait until it is whole again
			if err := waitTree(spid, n+1, 30*time.Second); err != nil {
				return row, err
			}
		}
	}
	row.Pause, row.Continue, row.Baseline = summarise(pauses), summarise(conts), summarise(base)
	row.PeakRSSKiB = peakRSS(spid)
	if kids, err := proc.Descendants(spid); err == nil {
		for _, k := range kids {
			if k.PPID == spid {
				row.ShimRSSKiB = peakRSS(k.PID)
			}
		}
	}
	if mode == supervisor.ModeStop {
		k, err := kernelStop(n, o.Iterations)
		if err != nil {
			return row, err
		}
		row.Kernel = &k
	}
	return row, nil
}

// waitTree polls until root has at least want descendants.
func waitTree(root, want int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		d, err := proc.Descendants(root)
		if err != nil {
			return err
		}
		if len(d) >= want {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("tree of %d processes not up within %s (have %d)", want, timeout, len(d))
		}
		time.Sleep(2 * time.Millisecond) // poll interval, bounded by the deadline above
	}
}

// waitAckFile polls until the acknowledgement file of op seq is in the
// session directory dir (a few seconds at most).
func waitAckFile(dir string, seq int64, op string) error {
	path := filepath.Join(dir, supervisor.AcksDir, fmt.Sprintf("%d.%s.json", seq, op))
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := os.Stat(path); err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not appear within 5s of its reply", path)
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// peakRSS reads VmHWM from /proc/PID/status, in KiB.
func peakRSS(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmHWM:") {
			f := strings.Fields(l)
			if len(f) >= 2 {
				v, _ := strconv.ParseInt(f[1], 10, 64)
				return v
			}
		}
	}
	return 0
}

// kernelStop stops and continues an identical tree directly, with no
// supervisor, and times each stop until every process shows stopped.
func kernelStop(n, iterations int) (Latency, error) {
	cmd := exec.Command("/bin/sh", "-c", treeScript, "bench-baseline", strconv.Itoa(n))
	cmd.SysProcAttr = &unix.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return Latency{}, err
	}
	defer func() {
		_ = unix.Kill(-cmd.Process.Pid, unix.SIGKILL)
		_ = cmd.Wait()
	}()
	if err := waitTree(cmd.Process.Pid, n-1, 30*time.Second); err != nil {
		return Latency{}, err
	}
	var d []time.Duration
	for i := 0; i < iterations; i++ {
		t0 := time.Now()
		tree, err := proc.Descendants(cmd.Process.Pid)
		if err != nil {
			return Latency{}, err
		}
		root, err := proc.ReadStat(cmd.Process.Pid)
		if err != nil {
			return Latency{}, err
		}
		tree = append(tree, root)
		for _, s := range tree {
			_ = unix.Kill(s.PID, unix.SIGSTOP)
		}
		deadline := time.Now().Add(10 * time.Second)
		for {
			done := true
			for _, s := range tree {
				st, err := proc.TaskStates(s.PID)
				if err == nil && !allStopped(st) {
					done = false
					break
				}
			}
			if done {
				break
			}
			if time.Now().After(deadline) {
				return Latency{}, fmt.Errorf("baseline tree did not stop")
			}
			ts := unix.NsecToTimespec(20_000) // poll interval (nanosleep: Go timers may be 1 ms coarse), bounded by the deadline above
			_ = unix.Nanosleep(&ts, nil)
		}
		d = append(d, time.Since(t0))
		for _, s := range tree {
			_ = unix.Kill(s.PID, unix.SIGCONT)
		}
	}
	return summarise(d), nil
}

func allStopped(states []byte) bool {
	for _, s := range states {
		if !proc.Stopped(s) {
			return false
		}
	}
	return true
}

// dirOr is dir, or when dir is empty a new temporary directory (its name
// begins with prefix) that remove removes; for a dir given, remove does
// nothing.
func dirOr(dir, prefix string) (d string, remove func(), err error) {
	if dir != "" {
		return dir, func() {}, nil
	}
	d, err = os.MkdirTemp("", prefix)
	if err != nil {
		return "", nil, err
	}
	return d, func() { os.RemoveAll(d) }, nil
}
