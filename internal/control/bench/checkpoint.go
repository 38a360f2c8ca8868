package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/relay"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	"stasis/internal/providers/local"
)

// CheckpointOptions configure Checkpoint.
type CheckpointOptions struct {
	Exe string   // the stasis binary (keepers, supervisors, mini)
	Env []string // extra environment for it
	// Sizes are the episode counts to measure (default 16, 64, 256).
	Sizes       []int
	Concurrency int // the coordinator's (default 256)
	Progress    io.Writer
}

// CheckpointResult is one size's figures.
type CheckpointResult struct {
	Episodes int `json:"episodes"`
	// Prepare phases: pause+snapshot+record of every episode (with
	// bounded concurrency), commit, continue; and the whole checkpoint.
	PrepareS  float64 `json:"prepare_s"`
	CommitS   float64 `json:"commit_s"`
	ContinueS float64 `json:"continue_s"`
	CheckS    float64 `json:"checkpoint_s"`
	// Per episode (p50, max): pause and snapshot.
	PauseP50S    float64 `json:"pause_p50_s"`
	PauseMaxS    float64 `json:"pause_max_s"`
	SnapshotP50S float64 `json:"snapshot_p50_s"`
	SnapshotMaxS float64 `json:"snapshot_max_s"`
	// Restore phases after every sandbox is gone: validate, fork, resume
	// (relaunch); and the whole restore.
	ValidateS float64 `json:"validate_s"`
	ForkS     float64 `json:"fork_s"`
	ResumeS   float64 `json:"resume_s"`
	RestoreS  float64 `json:"restore_s"`
	// Bytes: the snapshots' logical size; Stored: what the blob store
	// holds after the checkpoint (deduplicated).
	Bytes  int64 `json:"bytes"`
	Stored int64 `json:"stored_bytes"`
	// PeakRSSKiB is this process's peak resident memory (the coordinator,
	// gateway and model) after the size's run.
	PeakRSSKiB int64 `json:"peak_rss_kib"`
}

// Checkpoint measures checkpoint and restore of N concurrent mini-harness
// episodes on the local provider, for each size: every episode runs a
// built-in task (Python, shell and JavaScript ones, in turn) until its third
// model call, which the gateway holds; then the checkpoint is taken (the
// held calls are released once it is committed), every sandbox is killed
// as a crash would, and the checkpoint is restored by relaunch. The
// restored episodes are retired without waiting for them to finish.
func Checkpoint(ctx context.Context, o CheckpointOptions) ([]CheckpointResult, error) {
	if len(o.Sizes) == 0 {
		o.Sizes = []int{16, 64, 256}
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 256
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	for _, n := range o.Sizes {
		if n < 1 {
			return nil, errdefs.Errorf(errdefs.ErrInvalid, "--sizes %d: each size is a count of episodes, at least 1", n)
		}
	}
	var out []CheckpointResult
	for _, n := range o.Sizes {
		r, err := checkpointOnce(ctx, o, n)
		if err != nil {
			return out, fmt.Errorf("%d episodes: %w", n, err)
		}
		out = append(out, r)
	}
	return out, nil
}

func checkpointOnce(ctx context.Context, o CheckpointOptions, n int) (res CheckpointResult, err error) {
	res.Episodes = n
	ts, err := task.Builtin()
	if err != nil {
		return res, err
	}
	var quick []*task.Task
	for _, t := range ts {
		if t.Language != "go" { // Go tasks spend their time compiling
			quick = append(quick, t)
		}
	}
	dir, err := os.MkdirTemp("", "stasis-bench-ckpt-")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(dir)
	// The gateway holds every episode's third call until released.
	var holds relay.Holds
	third := holds.Add("", 3)
	defer third.Release()
	binEnv := map[string]string{}
	for _, kv := range o.Env {
		k, v, _ := strings.Cut(kv, "=")
		binEnv[k] = v
	}
	// The system as the server assembles it, the stasis binary bound into
	// each sandbox read-only: nothing to copy at start, nothing of it in
	// the snapshots.
	cfg := system.Config{
		State: filepath.Join(dir, "state"), Tasks: quick, Concurrency: o.Concurrency, LivenessInterval: -1,
		Exe: o.Exe, ExeEnv: o.Env, Binary: o.Exe, BinaryEnv: binEnv, GatewayMiddleware: holds.Middleware,
	}
	sys, err := system.Open(ctx, cfg)
	if err != nil {
		return res, err
	}
	home := filepath.Join(sys.State, local.Name)
	defer func() {
		if sys != nil {
			_ = sys.Coordinator.Shutdown(context.WithoutCancel(ctx))
			_ = sys.Close()
		}
		_, _ = local.Crash(home)
	}()
	if err := startHeld(ctx, sys.Coordinator, third, quick, o, n); err != nil {
		return res, err
	}

	fmt.Fprintf(o.Progress, "checkpoint bench: %d episodes held at their third call; checkpoint\n", n)
	// Each pause finds its episode waiting on a model call in flight, as a
	// checkpoint mid-episode usually does; the calls go on after it.
	pr, err := sys.Coordinator.Prepare(ctx, "bench")
	third.Release()
	if err != nil {
		return res, err
	}
	res.PrepareS, res.CommitS, res.ContinueS, res.CheckS = pr.Phases["prepare"], pr.Phases["commit"], pr.Phases["continue"], pr.Seconds
	var pauses, snaps []float64
	for _, f := range pr.Episodes {
		res.Bytes += f.Bytes
		if f.Snapshot != "" {
			pauses, snaps = append(pauses, f.PauseS), append(snaps, f.SnapshotS)
		}
	}
	res.PauseP50S, res.PauseMaxS = p50max(pauses)
	res.SnapshotP50S, res.SnapshotMaxS = p50max(snaps)
	res.Stored = duBytes(filepath.Join(home, "blobs"))

	// Lose every sandbox and the host side, as a crash would; a new
	// system on the same state restores.
	fmt.Fprintf(o.Progress, "checkpoint bench: crash and restore\n")
	if _, err := local.Crash(home); err != nil {
		return res, err
	}
	_ = sys.Close()
	if sys, err = system.Open(ctx, cfg); err != nil {
		return res, err
	}
	rr, err := sys.Coordinator.Restore(ctx, "bench")
	if err != nil {
		return res, err
	}
	res.ValidateS, res.ForkS, res.ResumeS, res.RestoreS = rr.Phases["validate"], rr.Phases["fork"], rr.Phases["resume"], rr.Seconds
	relaunched := 0
	for _, f := range rr.Episodes {
		if f.Resume == "relaunch" {
			relaunched++
		}
	}
	fmt.Fprintf(o.Progress, "checkpoint bench: prepare recorded %d episodes; restore relaunched %d of %d\n", len(pr.Episodes), relaunched, len(rr.Episodes))
	if relaunched == 0 {
		return res, fmt.Errorf("the restore relaunched no episode: %+v", rr)
	}
	res.PeakRSSKiB = peakRSS(os.Getpid())
	return res, nil
}

// startHeld starts n episodes of tasks, in turn, and waits until each is
// held at its third call.
func startHeld(ctx context.Context, c *coordinator.Coordinator, third *relay.Hold, tasks []*task.Task, o CheckpointOptions, n int) error {
	fmt.Fprintf(o.Progress, "checkpoint bench: starting %d episodes\n", n)
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
		sem  = make(chan struct{}, o.Concurrency)
	)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			t := tasks[i%len(tasks)]
			if _, err := c.Start(ctx, "ep-"+strconv.Itoa(i), t.ID, "mini"); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		return errs[0]
	}
	wctx, cancel := context.WithTimeoutCause(ctx, 5*time.Minute, fmt.Errorf("the episodes did not all reach their third model call in 5 minutes"))
	defer cancel()
	return third.Wait(wctx, n)
}

func p50max(xs []float64) (float64, float64) {
	if len(xs) == 0 {
		return 0, 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return s[len(s)/2], s[len(s)-1]
}

// duBytes is the disk space of the files under dir.
func duBytes(dir string) int64 {
	var n int64
	_ = filepath.Walk(dir, func(_ string, info os.FileInfo, err error) error {
		if err == nil && info.Mode().IsRegular() {
			n += info.Size()
		}
		return nil
	})
	return n
}
