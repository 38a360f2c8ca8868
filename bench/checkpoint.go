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
	r, err := newCheckpointRig(o, n)
	if err != nil {
		return res, err
	}
	defer r.close()
	c, err := coordinator.New(ctx, coordinator.Options{Env: r.env, Store: r.st, Tasks: r.quick, Concurrency: o.Concurrency})
	if err != nil {
		return res, err
	}
	defer func() { _ = c.Shutdown(context.WithoutCancel(ctx)) }()
	if err := r.startHeld(ctx, c, o, n); err != nil {
		return res, err
	}

	fmt.Fprintf(o.Progress, "checkpoint bench: %d episodes held at their third call; checkpoint\n", n)
	// Each pause finds its episode waiting on a model call in flight, as a
	// checkpoint mid-episode usually does; the calls go on after it.
	pr, err := c.Prepare(ctx, "bench")
	r.release()
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
	res.Stored = duBytes(filepath.Join(r.home, "blobs"))

	// Lose every sandbox, as a crash would, and restore.
	fmt.Fprintf(o.Progress, "checkpoint bench: crash and restore\n")
	if _, err := local.Crash(r.home); err != nil {
		return res, err
	}
	c.Close()
	if _, err := r.p.GC(ctx); err != nil {
		return res, err
	}
	c, err = coordinator.New(ctx, coordinator.Options{Env: r.env, Store: r.st, Tasks: r.quick, Concurrency: o.Concurrency})
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

// checkpointRig is what a checkpoint bench runs on: the quick built-in
// tasks, the scripted model, the gateway (holding every episode's third
// call until release), the local provider and the store, in a temporary
// directory.
type checkpointRig struct {
	quick   []*task.Task
	home    string
	p       *local.Provider
	st      *store.SQLite
	env     *episode.Env
	held    sync.WaitGroup // done as each episode's third call is held
	release func()
	stops   []func() // close stops them, last first
}

func newCheckpointRig(o CheckpointOptions, n int) (r *checkpointRig, err error) {
	r = &checkpointRig{}
	defer func() {
		if err != nil {
			r.close()
		}
	}()
	ts, err := task.Builtin()
	if err != nil {
		return nil, err
	}
	for _, t := range ts {
		if t.Language != "go" { // Go tasks spend their time compiling
			r.quick = append(r.quick, t)
		}
	}
	scripts, err := task.Scripts(r.quick)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "stasis-bench-ckpt-")
	if err != nil {
		return nil, err
	}
	r.stops = append(r.stops, func() { os.RemoveAll(dir) })

	mln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	msrv := &http.Server{Handler: model.New(model.Options{Scripts: scripts})}
	go func() { _ = msrv.Serve(mln) }()
	r.stops = append(r.stops, func() { msrv.Close() })

	gw, err := relay.OpenGateway(relay.GatewayConfig{Upstream: "http://" + mln.Addr().String(), State: filepath.Join(dir, "gateway")})
	if err != nil {
		return nil, err
	}
	r.stops = append(r.stops, func() { gw.Close() })
	sockDir := filepath.Join(dir, "gw")
	if err := os.MkdirAll(sockDir, 0o755); err != nil {
		return nil, err
	}
	// Each sandbox reaches the gateway on a socket of its own.
	sockets := relay.NewSandboxSockets(gw, r.hold(n))
	r.stops = append(r.stops, func() { sockets.Close() }, r.release)

	r.home = filepath.Join(dir, "local")
	// The stasis binary is bound into each sandbox read-only: nothing to
	// copy at start, nothing of it in the snapshots.
	if r.p, err = local.New(local.Options{Home: r.home, Exe: o.Exe, ExeEnv: o.Env, GatewayDir: sockDir, Gateway: sockets,
		ReadOnlyBinds: map[string]string{o.Exe: harness.BoundBinaryPath}}); err != nil {
		return nil, err
	}
	r.stops = append(r.stops, func() { _, _ = local.Crash(r.home) })
	if r.st, err = store.OpenSQLite(filepath.Join(dir, "store.db")); err != nil {
		return nil, err
	}
	r.stops = append(r.stops, func() { r.st.Close() })
	binEnv := map[string]string{}
	for _, kv := range o.Env {
		k, v, _ := strings.Cut(kv, "=")
		binEnv[k] = v
	}
	r.env = &episode.Env{
		Provider: r.p, Gateway: gw, GatewayURL: "unix://" + local.GatewayDirInSandbox + "/" + local.GatewaySocketName, Model: model.DefaultName,
		Verifier: &task.Verifier{Store: r.st, Provider: r.p}, Binary: o.Exe, BinaryEnv: binEnv, BinaryInSandbox: harness.BoundBinaryPath,
	}
	return r, nil
}

// hold wraps the gateway so that it holds every episode's third call (of
// its first attempt) until release; n episodes are waited for.
func (r *checkpointRig) hold(n int) func(http.Handler) http.Handler {
	release := make(chan struct{})
	r.release = sync.OnceFunc(func() { close(release) })
	r.held.Add(n)
	var once sync.Map
	return func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
			call := q.Header.Get(relay.HeaderCallID)
			if strings.HasSuffix(call, "/3") && q.Header.Get(relay.HeaderAttempt) == "0" {
				if _, dup := once.LoadOrStore(call, true); !dup {
					r.held.Done()
				}
				select {
				case <-release:
				case <-q.Context().Done():
					return
				}
			}
			h.ServeHTTP(w, q)
		})
	}
}

func (r *checkpointRig) close() {
	for i := len(r.stops) - 1; i >= 0; i-- {
		r.stops[i]()
	}
}

// startHeld starts n episodes of the quick tasks, in turn, and waits until
// each is held at its third call.
func (r *checkpointRig) startHeld(ctx context.Context, c *coordinator.Coordinator, o CheckpointOptions, n int) error {
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
			t := r.quick[i%len(r.quick)]
			if _, err := c.Start(ctx, "ep-"+strconv.Itoa(i), t.ID, "mini"); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
				r.held.Done()
			}
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		return errs[0]
	}
	heldAll := make(chan struct{})
	go func() { r.held.Wait(); close(heldAll) }()
	select {
	case <-heldAll:
	case <-time.After(5 * time.Minute):
		return fmt.Errorf("the episodes did not all reach their third model call in 5 minutes")
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
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
