package bench

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"stasis/coordinator"
	"stasis/episode"
	"stasis/harness"
	"stasis/model"
	"stasis/relay"
	"stasis/sandbox/local"
	"stasis/store"
	"stasis/task"
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
	scripts, err := task.Scripts(quick)
	if err != nil {
		return res, err
	}
	dir, err := os.MkdirTemp("", "stasis-bench-ckpt-")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(dir)

	mln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return res, err
	}
	msrv := &http.Server{Handler: model.New(model.Options{Scripts: scripts})}
	go func() { _ = msrv.Serve(mln) }()
	defer msrv.Close()

	gw, err := relay.OpenGateway(relay.GatewayConfig{Upstream: "http://" + mln.Addr().String(), State: filepath.Join(dir, "gateway")})
	if err != nil {
		return res, err
	}
	defer gw.Close()
	sockDir := filepath.Join(dir, "gw")
	if err := os.MkdirAll(sockDir, 0o755); err != nil {
		return res, err
	}
	// The gateway holds every episode's third call until released.
	var holds relay.Holds
	third := holds.Add("", 3)
	// Each sandbox reaches the gateway on a socket of its own.
	sockets := relay.NewSandboxSockets(gw, holds.Middleware)
	defer sockets.Close()
	defer third.Release()

	home := filepath.Join(dir, "local")
	// The stasis binary is bound into each sandbox read-only: nothing to
	// copy at start, nothing of it in the snapshots.
	p, err := local.New(local.Options{Home: home, Exe: o.Exe, ExeEnv: o.Env, GatewayDir: sockDir, Gateway: sockets,
		ReadOnlyBinds: map[string]string{o.Exe: harness.BoundBinaryPath}})
	if err != nil {
		return res, err
	}
	defer func() { _, _ = local.Crash(home) }()
	st, err := store.OpenSQLite(filepath.Join(dir, "store.db"))
	if err != nil {
		return res, err
	}
	defer st.Close()
	binEnv := map[string]string{}
	for _, kv := range o.Env {
		k, v, _ := strings.Cut(kv, "=")
		binEnv[k] = v
	}
	env := &episode.Env{
		Provider: p, Gateway: gw, GatewayURL: "unix://" + local.GatewayDirInSandbox + "/" + local.GatewaySocketName, Model: model.DefaultName,
		Verifier: &task.Verifier{Store: st, Provider: p}, Binary: o.Exe, BinaryEnv: binEnv, BinaryInSandbox: harness.BoundBinaryPath,
	}
	c, err := coordinator.New(ctx, coordinator.Options{Env: env, Store: st, Tasks: quick, Concurrency: o.Concurrency})
	if err != nil {
		return res, err
	}
	defer func() { _ = c.Shutdown(context.WithoutCancel(ctx)) }()

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
			t := quick[i%len(quick)]
			if _, err := c.Start(ctx, "ep-"+strconv.Itoa(i), t.ID, "mini"); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		return res, errs[0]
	}
	wctx, cancelWait := context.WithTimeoutCause(ctx, 5*time.Minute, fmt.Errorf("the episodes did not all reach their third model call in 5 minutes"))
	err = third.Wait(wctx, n)
	cancelWait()
	if err != nil {
		return res, err
	}

	fmt.Fprintf(o.Progress, "checkpoint bench: %d episodes held at their third call; checkpoint\n", n)
	// Each pause finds its episode waiting on a model call in flight, as a
	// checkpoint mid-episode usually does; the calls go on after it.
	pr, err := c.Prepare(ctx, "bench")
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

	// Lose every sandbox, as a crash would, and restore.
	fmt.Fprintf(o.Progress, "checkpoint bench: crash and restore\n")
	if _, err := local.Crash(home); err != nil {
		return res, err
	}
	c.Close()
	if _, err := p.GC(ctx); err != nil {
		return res, err
	}
	c, err = coordinator.New(ctx, coordinator.Options{Env: env, Store: st, Tasks: quick, Concurrency: o.Concurrency})
	if err != nil {
		return res, err
	}
	rr, err := c.Restore(ctx, "bench")
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
