// Package episode owns one episode's life on a provider: a sandbox seeded
// with a task's work tree, a harness launched in it under the supervisor,
// the relay wired to the host's gateway, waiting for the harness to end,
// capture-once verify, a snapshot of a paused episode, and the relaunch of
// an episode from a fork of its snapshot (the harness continues its saved
// session, and the gateway matches its history against the ledger). The
// checkpoint coordinator and `stasis run` drive many of these.
package episode

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/checkpoint"
	"stasis/internal/control/relay"
	"stasis/internal/control/task"
	"stasis/internal/guestclock"
	"stasis/internal/insandbox/harness"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/proc"
	"stasis/sandbox"
)

// RelayAddr is where the harness reaches the relay inside a sandbox. Each
// sandbox has its own network namespace, so one fixed port serves all.
const RelayAddr = "127.0.0.1:7411"

// callsPerAttempt spaces the call numbers of relaunched attempts: attempt
// a's relay numbers its calls from a×callsPerAttempt+1, so that a relaunch
// never reuses a call id the ledger holds.
const callsPerAttempt = 1_000_000

// Env is what the episodes of one run share.
type Env struct {
	Provider sandbox.Provider
	Gateway  *relay.Gateway
	// GatewayURL is the gateway as relays inside sandboxes reach it (for
	// the local provider a unix:// socket in a directory bound into every
	// sandbox).
	GatewayURL string
	// Model is the model name harnesses ask for.
	Model    string
	Verifier *task.Verifier
	// Binary and BinaryEnv: the stasis binary placed in sandboxes (tests
	// run their own test binary as stasis).
	Binary    string
	BinaryEnv map[string]string
	// BinaryInSandbox, when set, is where the provider binds the stasis
	// binary into every sandbox (read-only; see harness.BoundBinaryPath):
	// nothing is copied and snapshots do not carry it.
	BinaryInSandbox string
	// StopConfirmTimeout bounds a stop pause's wait (default 60s).
	StopConfirmTimeout time.Duration
	// ClockPolicy sets a guest's wall clock when an episode resumes in
	// place: ClockContinuous (the default) or ClockHost.
	ClockPolicy string
	// Image is the sandboxes' image where neither the episode nor its task
	// names one (empty: the provider's own root).
	Image string
}

// Clock policies for a resume in place. Uptime always continues from the
// snapshot; the wall clock is set by the policy.
const (
	// ClockContinuous: guest wall = pause_wall + (uptime now − pause_uptime),
	// as if no time had passed outside the guest while it was saved.
	ClockContinuous = "continuous"
	// ClockHost: guest wall = host wall.
	ClockHost = "host"
)

// ClockSetter is implemented by providers whose own agent in the sandbox
// sets its wall clock (the microVM's guest agent). Others get the
// in-sandbox binary's `clock set` through Exec. Either way the target is
// computed inside the sandbox from its own uptime (guestclock).
type ClockSetter interface {
	SetClock(ctx context.Context, id string, t guestclock.Target) (guestclock.Fix, error)
}

// Spec describes one episode.
type Spec struct {
	// ID is the episode's id inside its sandbox (its session directory).
	ID string
	// Name is its name at the gateway, in the store and in verdicts when
	// that differs from ID: a copy made from another episode's snapshot
	// (ResumeCopy, RelaunchCopy) keeps the original's paths inside the
	// sandbox under a name of its own. Empty: ID.
	Name    string
	Task    *task.Task
	Harness harness.Adapter
	// Expiry is the sandbox's absolute expiry (default: now + twice the
	// budget + 10 minutes).
	Expiry time.Time
	// Deadline is the harness's time budget (default: the task's).
	Deadline time.Duration
	// PauseMode is how checkpoints pause the harness: hold (the relay
	// holds its model calls; only where snapshots keep processes) or stop
	// (SIGSTOP). Default: hold where the provider's snapshots keep
	// processes, stop elsewhere.
	PauseMode supervisor.Mode
	// Limits bound the episode's sandbox (zero fields: the provider's
	// defaults); exceeding one ends the episode with the reason.
	Limits sandbox.Limits
	// Image is the episode's sandbox image (default: the task's, then
	// Env.Image); see sandbox.Spec.Image.
	Image string
	// Labels are more labels for the sandbox Start makes (the
	// coordinator's operation, to find it again after a crash).
	Labels map[string]string

	environ task.Environment // resolved by prepare
}

// ImageOf is the image an episode's sandbox runs on: the episode's own,
// else its task's, else the environment's default.
func (env *Env) ImageOf(spec Spec) string {
	switch {
	case spec.Image != "":
		return spec.Image
	case spec.Task != nil && spec.Task.Image != "":
		return spec.Task.Image
	}
	return env.Image
}

// name is the episode's name at the gateway and in the store.
func (spec Spec) name() string {
	if spec.Name != "" {
		return spec.Name
	}
	return spec.ID
}

// ExpiryFrom is the sandbox expiry of an episode (re)started at now when
// its spec sets none: twice its budget and ten minutes later.
func (spec Spec) ExpiryFrom(now time.Time) time.Time {
	return now.Add(2*spec.budget() + 10*time.Minute)
}

// budget is the harness's time budget.
func (spec Spec) budget() time.Duration {
	if spec.Deadline > 0 {
		return spec.Deadline
	}
	return spec.Task.Budget()
}

// Episode is a running (or ended) episode.
type Episode struct {
	env  *Env
	spec Spec
	// name is the episode's name at the gateway and in the verdicts:
	// spec.ID, but for a copy made by ResumeCopy (whose sandbox still
	// holds the original's files, under the original's id).
	name    string
	sess    *checkpoint.Session
	launch  harness.Launch
	attempt int
	clock   ClockFix
	// resumeSeq is the pause Go continues (ReadyInPlace); 0 for a launch.
	resumeSeq int64
}

// ClockFix is what a resume in place did to the guest's wall clock.
type ClockFix struct {
	Policy string  `json:"policy"`
	Uptime float64 `json:"uptime"` // the guest's uptime when the clock was set
	// Before and After are the guest's wall clock (unix seconds) before
	// and after it was set; Step is After − Before.
	Before float64 `json:"before"`
	After  float64 `json:"after"`
	Step   float64 `json:"step_s"`
}

// Clock reports what ResumeInPlace did to the guest's clock (zero for
// an episode that did not resume in place).
func (e *Episode) Clock() ClockFix { return e.clock }

// setClock sets a resumed guest's wall clock by the env's policy: uptime
// continues from the snapshot; continuous sets wall = pause_wall + (uptime
// now − pause_uptime), host sets the host's wall. The guest computes the
// continuous target from its own uptime as it sets the clock (guestclock),
// so it lands within microseconds of that, whatever the way in costs.
func (env *Env) setClock(ctx context.Context, sess *checkpoint.Session, rec checkpoint.State) (ClockFix, error) {
	f := ClockFix{Policy: env.ClockPolicy}
	if f.Policy == "" {
		f.Policy = ClockContinuous
	}
	var t guestclock.Target
	switch f.Policy {
	case ClockContinuous:
		t = guestclock.Target{Continuous: true, PauseWall: rec.PauseWall, PauseUptime: rec.PauseUptime}
	case ClockHost:
		now := time.Now()
		t = guestclock.Target{Wall: float64(now.Unix()) + float64(now.Nanosecond())/1e9}
	default:
		return f, fmt.Errorf("clock policy %q: use %s or %s", f.Policy, ClockContinuous, ClockHost)
	}
	var g guestclock.Fix
	var err error
	if cs, ok := env.Provider.(ClockSetter); ok {
		g, err = cs.SetClock(ctx, sess.SandboxID(), t)
	} else {
		g, err = sess.SetClock(ctx, t)
	}
	if err != nil {
		return f, fmt.Errorf("set the guest's clock (%s policy): %w", f.Policy, err)
	}
	f.Uptime, f.Before, f.After = g.Uptime, g.Before, g.After
	f.Step = f.After - f.Before
	return f, nil
}

// dirs inside the sandbox.
func sessionDir(id string) string { return checkpoint.SessionDir(id) }
func tokenFile(id string) string  { return path.Join(sessionDir(id), "token.json") }

func (env *Env) launch(spec Spec) harness.Launch {
	return harness.Launch{
		Episode: spec.ID, Prompt: spec.Task.Prompt(), WorkDir: task.WorkDir,
		Dir: path.Join(sessionDir(spec.ID), "harness"), ModelURL: "http://" + RelayAddr + "/v1", Model: env.Model,
		Stasis: env.BinaryInSandbox,
	}
}

func (env *Env) sessionOptions(spec Spec, cmd harness.Command, attempt int) checkpoint.SessionOptions {
	menv := spec.Task.EnvMap()
	for k, v := range cmd.Env {
		menv[k] = v
	}
	mode := spec.PauseMode
	if mode == "" {
		mode = DefaultPauseMode(env.Provider)
	}
	sct := env.StopConfirmTimeout
	if sct == 0 {
		sct = time.Minute
	}
	return checkpoint.SessionOptions{
		Provider: env.Provider, Episode: spec.ID, Dir: sessionDir(spec.ID), PauseMode: mode,
		Harness: cmd.Argv, ResumeCmd: cmd.ResumeCmd, Deadline: spec.budget(), StopConfirmTimeout: sct,
		Binary: env.Binary, BinaryEnv: env.BinaryEnv, BinaryInSandbox: env.BinaryInSandbox, Env: menv, Attempt: attempt,
		Relay: &checkpoint.RelayOptions{Listen: RelayAddr, Upstream: env.GatewayURL, TokenFile: tokenFile(spec.ID)},
	}
}

// prepare checks the spec and resolves the task's environment (the
// sandbox, the harness and the tests run with it).
func (spec *Spec) prepare(ctx context.Context) error {
	if err := spec.check(); err != nil {
		return err
	}
	e, err := spec.Task.Environment(ctx)
	if err != nil {
		return fmt.Errorf("episode %s: %w", spec.ID, err)
	}
	spec.environ = e
	return nil
}

func (spec *Spec) check() error {
	if spec.Task == nil || spec.Harness == nil {
		return fmt.Errorf("episode %s: a task and a harness are needed", spec.ID)
	}
	if spec.Deadline < 0 {
		return fmt.Errorf("episode %s: a negative deadline", spec.ID)
	}
	if spec.Expiry.IsZero() {
		spec.Expiry = spec.ExpiryFrom(time.Now())
	}
	switch spec.PauseMode {
	case "", supervisor.ModeStop, supervisor.ModeHold, supervisor.ModeHoldFreeze:
	default:
		return fmt.Errorf("episode %s: pause mode %q: use stop, hold or hold+freeze", spec.ID, spec.PauseMode)
	}
	return nil
}

// DefaultPauseMode is hold where the provider's snapshots keep processes
// (the snapshot is atomic over them), stop elsewhere.
func DefaultPauseMode(p sandbox.Provider) supervisor.Mode {
	if p.Capabilities().KeepsProcesses {
		return supervisor.ModeHold
	}
	return supervisor.ModeStop
}

// Start makes the episode's sandbox from the task's work tree, installs and
// prepares the harness, registers the episode with the gateway, and
// launches the harness under the supervisor. On an error nothing is left
// behind but the gateway's registration.
func Start(ctx context.Context, env *Env, spec Spec) (*Episode, error) {
	return start(ctx, env, spec, false)
}

// Restart is Start of an episode the gateway knows already (retired, or
// lost when its sandbox went): a new sandbox from the task's work tree and the
// harness launched afresh, as the episode's next attempt. The gateway is
// moved to that attempt (relay.Gateway.Restart: the ledger starts empty,
// calls of older attempts are refused) once the sandbox is made; on an
// error before that nothing has changed, after it the gateway stays at
// the new attempt and the sandbox is deleted.
func Restart(ctx context.Context, env *Env, spec Spec) (*Episode, error) {
	return start(ctx, env, spec, true)
}

func start(ctx context.Context, env *Env, spec Spec, again bool) (*Episode, error) {
	if err := spec.prepare(ctx); err != nil {
		return nil, err
	}
	tree, err := os.MkdirTemp("", "stasis-task-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tree)
	if err := spec.Task.Materialize(tree); err != nil {
		return nil, fmt.Errorf("episode %s: %w", spec.ID, err)
	}
	var st relay.EpisodeState
	if again {
		if st, err = env.Gateway.Episode(spec.ID); err != nil {
			return nil, fmt.Errorf("episode %s: start it again: %w", spec.ID, err)
		}
		st.Attempt++ // what Restart makes it, once the sandbox is there
	} else if st, err = env.Gateway.AddEpisode(spec.ID); err != nil {
		return nil, fmt.Errorf("episode %s: register with the gateway: %w", spec.ID, err)
	}
	e := &Episode{env: env, spec: spec, name: spec.ID, launch: env.launch(spec), attempt: st.Attempt}
	o := env.sessionOptions(spec, spec.Harness.Start(e.launch), st.Attempt)
	img := env.ImageOf(spec)
	senv := spec.Task.EnvMap()
	if _, own := spec.Task.Env["PATH"]; img != "" && !own {
		delete(senv, "PATH") // the image's own PATH, not the host's
	}
	labels := map[string]string{"stasis.task": spec.Task.ID, "stasis.harness": spec.Harness.Name()}
	for k, v := range spec.Labels {
		labels[k] = v
	}
	o.Spec = sandbox.Spec{Root: tree, Env: senv, Expiry: spec.Expiry, Limits: spec.Limits, Image: img, Labels: labels}
	sess, err := checkpoint.NewSession(ctx, o)
	if err != nil {
		return nil, fmt.Errorf("episode %s: %w", spec.ID, err)
	}
	e.sess = sess
	cred := st.Credentials(0)
	if again {
		err = e.restartAttempt(st.Attempt)
		cred = st.Credentials(int64(st.Attempt)*callsPerAttempt + 1)
	}
	if err == nil {
		err = e.boot(ctx, cred, true)
	}
	if err != nil {
		if cerr := closeRetrying(ctx, sess); cerr != nil {
			return nil, fmt.Errorf("%w; and its sandbox %s could not be deleted: %v", err, sess.SandboxID(), cerr)
		}
		return nil, err
	}
	return e, nil
}

// restartAttempt moves the gateway to the episode's next attempt, which
// must be attempt (another restart or restore did not go first).
func (e *Episode) restartAttempt(attempt int) error {
	st, err := e.env.Gateway.Restart(e.name)
	if err != nil {
		return fmt.Errorf("episode %s: start its attempt %d at the gateway: %w", e.name, attempt, err)
	}
	if st.Attempt != attempt {
		return errdefs.Errorf(errdefs.ErrConflict, "episode %s: the gateway went to attempt %d, not %d: it was started or restored again meanwhile", e.name, st.Attempt, attempt)
	}
	return nil
}

// closeRetrying closes a session (deleting the sandbox it owns), retrying
// transient failures; Close is safe to retry.
func closeRetrying(ctx context.Context, sess *checkpoint.Session) error {
	ctx = context.WithoutCancel(ctx)
	return checkpoint.Retry(func() error { return sess.Close(ctx) })
}

// boot installs and prepares the harness, writes the relay's credentials,
// and starts the supervisor. fresh: the sandbox was just made from the
// task's tree (not a relaunch's fork), so a Go build cache seed may be
// made in it.
func (e *Episode) boot(ctx context.Context, cred relay.Credentials, fresh bool) error {
	if err := e.ready(ctx, cred, fresh); err != nil {
		return err
	}
	return e.bindAndStart(ctx)
}

// ready installs and prepares the harness and writes the relay's
// credentials: everything a launch needs, all of it inside the sandbox.
func (e *Episode) ready(ctx context.Context, cred relay.Credentials, fresh bool) error {
	p, id := e.env.Provider, e.sess.SandboxID()
	// The session directory is stasis's own; the harness gets harness/.
	if err := e.sess.PrepareDirs(ctx, path.Base(e.launch.Dir)); err != nil {
		return fmt.Errorf("episode %s: %w", e.spec.ID, err)
	}
	// A Go task: its build cache seed, made here first if the task has
	// none yet (the sandbox holds the task's tree and nothing of an agent:
	// a trusted run), and the agent's own cache starts from a copy (its
	// default GOCACHE, under its home). The agent's first build and every
	// verify of the task then compile only what changed.
	// Only in a fresh sandbox: a relaunch's fork holds what the agent did.
	seed := ""
	if fresh {
		var err error
		if seed, err = e.env.Verifier.SeedIn(ctx, e.spec.Task, id); err != nil {
			// Slower, not wrong: the agent and the verifies build from
			// empty caches (and a later start tries again).
			slog.Warn("no Go build cache seed was made at the episode's start", "episode", e.spec.ID, "task", e.spec.Task.ID, "err", err)
		}
	}
	if seed != "" {
		if home, err := e.sess.AgentHome(ctx); err == nil && home != "" {
			if err := task.UploadSeed(ctx, p, id, path.Join(home, ".cache", "go-build"), seed); err != nil {
				slog.Warn("the agent's Go build cache was not seeded", "episode", e.spec.ID, "err", err)
			}
		}
	}
	if err := e.spec.Harness.Install(ctx, p, id); err != nil {
		return fmt.Errorf("episode %s: install %s: %w", e.spec.ID, e.spec.Harness.Name(), err)
	}
	if err := e.spec.Harness.Prepare(ctx, p, id, e.launch); err != nil {
		return fmt.Errorf("episode %s: prepare %s: %w", e.spec.ID, e.spec.Harness.Name(), err)
	}
	return e.writeCredentials(ctx, cred)
}

// writeCredentials writes the relay's token file, naming this node's
// gateway as the relay's upstream (a relay resumed in place from another
// node's snapshot sends its calls here from the continue on).
func (e *Episode) writeCredentials(ctx context.Context, cred relay.Credentials) error {
	cred.Upstream = e.env.GatewayURL
	b, err := json.Marshal(cred)
	if err != nil {
		return err
	}
	if err := e.sess.WriteSecret(ctx, path.Base(tokenFile(e.spec.ID)), b); err != nil {
		return fmt.Errorf("episode %s: write the relay's credentials: %w", e.spec.ID, err)
	}
	return nil
}

// bind makes the episode's token valid on its sandbox's socket only.
func (e *Episode) bind() error {
	if err := e.env.Gateway.Bind(e.name, e.sess.SandboxID()); err != nil {
		return fmt.Errorf("episode %s: bind it to sandbox %s at the gateway: %w", e.spec.ID, e.sess.SandboxID(), err)
	}
	return nil
}

// bindAndStart binds the episode at the gateway and starts the supervisor.
func (e *Episode) bindAndStart(ctx context.Context) error {
	if err := e.bind(); err != nil {
		return err
	}
	if err := e.sess.Start(ctx); err != nil {
		return fmt.Errorf("episode %s: %w", e.spec.ID, err)
	}
	return nil
}

// ID is the episode's id.
func (e *Episode) ID() string { return e.name }

// SandboxID is the episode's sandbox.
func (e *Episode) SandboxID() string { return e.sess.SandboxID() }

// Environment is what the episode's harness and tests run in.
func (e *Episode) Environment() task.Environment { return e.spec.environ }

// Attempt is the episode's attempt (0 before any restore).
func (e *Episode) Attempt() int { return e.attempt }

// Session is the episode's checkpoint session (pause, continue, status).
func (e *Episode) Session() *checkpoint.Session { return e.sess }

// Status asks the supervisor.
func (e *Episode) Status(ctx context.Context) (*supervisor.Status, error) { return e.sess.Status(ctx) }

// Wait polls until the supervisor has ended and returns its receipt.
func (e *Episode) Wait(ctx context.Context) (*supervisor.Receipt, error) {
	for {
		st, err := e.sess.Status(ctx)
		if err != nil {
			return nil, err
		}
		if st.State == supervisor.StateExited && st.Receipt != nil {
			return st.Receipt, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("episode %s: wait: %w (state %s)", e.spec.ID, ctx.Err(), st.State)
		case <-time.After(100 * time.Millisecond): // poll interval
		}
	}
}

// ended confirms that the harness has ended and its cleanup is confirmed.
func (e *Episode) ended(ctx context.Context) error {
	st, err := e.sess.Status(ctx)
	if err != nil {
		return err
	}
	if st.State != supervisor.StateExited || st.Receipt == nil {
		return fmt.Errorf("the supervisor reports %s", st.State)
	}
	if !st.Receipt.CleanupConfirmed {
		return fmt.Errorf("the harness's processes were not all gone at its end (left: %v)", st.Receipt.Leftover)
	}
	// An episode whose ledger has no record never made a model call, in
	// this attempt or any before it: the model never acted.
	if tip, err := e.env.Gateway.Tip(e.name); err == nil && tip.Records == 0 {
		return &task.NoModelCall{Reason: "the harness ended (" + describeEnd(st.Receipt) + ") before the episode made any model call: the model never acted, so there is nothing of it to judge"}
	}
	return nil
}

// describeEnd says how a harness ended, from its receipt.
func describeEnd(r *supervisor.Receipt) string {
	var s string
	switch {
	case r.ReturnCode == nil:
		s = "it never ran"
	case r.TimedOut:
		s = "killed at its deadline"
	case r.Stopped:
		s = "stopped"
	case *r.ReturnCode < 0:
		s = fmt.Sprintf("killed by signal %d", -*r.ReturnCode)
	default:
		s = fmt.Sprintf("exit %d", *r.ReturnCode)
	}
	if r.Error != "" {
		s += ": " + r.Error
	}
	return s
}

// Verify runs the task's tests once the harness has ended (capture once:
// see task.Verifier).
func (e *Episode) Verify(ctx context.Context) (task.Verdict, bool, error) {
	if e.env.Verifier == nil {
		return task.Verdict{}, false, errors.New("episode: no verifier")
	}
	return e.env.Verifier.Verify(ctx, e.name, e.attempt, e.sess.SandboxID(), e.spec.Task, e.ended)
}

// Snapshot is a paused episode's snapshot and its checkpoint state.
type Snapshot struct {
	ID    string
	State checkpoint.State
	// Pause is how long the pause took to be acknowledged; Took the
	// snapshot after it.
	Pause, Took time.Duration
}

// PauseAndSnapshot pauses the episode (pause n, stop mode), records the
// harness's session, snapshots the sandbox, and continues it when
// continueAfter is set.
func (e *Episode) PauseAndSnapshot(ctx context.Context, n int64, continueAfter bool) (Snapshot, error) {
	snap, err := e.PauseAndSnapshotWith(ctx, n, nil)
	if err != nil || !continueAfter {
		return snap, err
	}
	if _, err := e.sess.Continue(ctx, n); err != nil {
		return Snapshot{}, err
	}
	return snap, nil
}

// SnapshotName is the name PauseAndSnapshot gives the snapshot of pause n:
// with the sandbox it is taken of, it finds a snapshot whose id was lost.
func (e *Episode) SnapshotName(n int64) string { return fmt.Sprintf("%s-p%d", e.spec.ID, n) }

// PauseAndSnapshotWith pauses the episode (pause n), records the
// harness's session and snapshots the sandbox (named SnapshotName(n)),
// leaving the pause in force. between, when set, is called once the pause
// is acknowledged, before the snapshot; an error from it ends the call
// there.
func (e *Episode) PauseAndSnapshotWith(ctx context.Context, n int64, between func() error) (Snapshot, error) {
	t0 := time.Now()
	ack, err := e.sess.Pause(ctx, n)
	if err != nil {
		return Snapshot{}, err
	}
	pause := time.Since(t0)
	// The harness's saved session is asked for only once the harness has
	// had a model call answered. Before that it has no conversation to
	// resume (a relaunch then finds its newest session itself, or starts
	// the task afresh), and asking may race its start-up: two OpenCode
	// processes that open one new database at once both migrate it, and
	// one fails, the harness as likely as the query (OpenCode exits 1).
	if ack.RelayDelivered == nil || *ack.RelayDelivered > 0 {
		if sid, err := e.spec.Harness.Session(ctx, e.env.Provider, e.sess.SandboxID(), e.launch); err == nil && sid != "" {
			e.sess.SetHarnessSession(sid)
		}
	}
	st, err := e.sess.CheckpointState(ctx)
	if err != nil {
		return Snapshot{}, err
	}
	if st.RelayPosition != nil || st.RelayDelivered != nil {
		// The entry the cut ends at, for an in-place restore to check.
		if st.LedgerHead, err = e.env.Gateway.Head(e.name, st.LedgerCut()); err != nil {
			return Snapshot{}, fmt.Errorf("episode %s: its ledger's head at the pause: %w", e.spec.ID, err)
		}
	}
	// The ledger's last record, for a restore of this checkpoint to take
	// the ledger back to however far it has moved on by then.
	tip, err := e.env.Gateway.Tip(e.name)
	if err != nil {
		return Snapshot{}, fmt.Errorf("episode %s: its ledger's tip at the pause: %w", e.spec.ID, err)
	}
	st.LedgerTip = tip.Hash
	if between != nil {
		if err := between(); err != nil {
			return Snapshot{}, err
		}
	}
	t1 := time.Now()
	info, err := e.env.Provider.Snapshot(ctx, e.sess.SandboxID(), e.SnapshotName(n))
	if err != nil {
		return Snapshot{}, fmt.Errorf("episode %s: snapshot: %w", e.spec.ID, err)
	}
	return Snapshot{ID: info.ID, State: st, Pause: pause, Took: time.Since(t1)}, nil
}

// Relaunch continues an episode in a fork of its snapshot by relaunching
// its harness there (RelaunchIn); the fork belongs to the new Episode.
func Relaunch(ctx context.Context, env *Env, spec Spec, snap Snapshot) (*Episode, error) {
	if err := spec.prepare(ctx); err != nil {
		return nil, err
	}
	forks, err := env.Provider.Fork(ctx, snap.ID, 1, ForkSpec(spec))
	if err != nil {
		return nil, fmt.Errorf("episode %s: fork %s: %w", spec.ID, snap.ID, err)
	}
	e, err := RelaunchIn(ctx, env, spec, forks[0].ID, snap.State.HarnessSession, snap.State.LedgerTip)
	if err != nil {
		_ = env.Provider.Delete(context.WithoutCancel(ctx), forks[0].ID)
		return nil, err
	}
	return e, nil
}

// ForkSpec is how a restore forks an episode's snapshot.
func ForkSpec(spec Spec) sandbox.ForkSpec {
	if spec.Expiry.IsZero() && spec.Task != nil {
		spec.Expiry = spec.ExpiryFrom(time.Now())
	}
	return sandbox.ForkSpec{
		Labels: map[string]string{"stasis.episode": spec.name(), "stasis.task": spec.Task.ID, "stasis.harness": spec.Harness.Name()},
		Expiry: spec.Expiry,
		Limits: spec.Limits,
	}
}

// RelaunchIn continues an episode in sandbox (a fork of its snapshot) by
// relaunching its harness: the gateway starts the next attempt and will
// match the relaunched harness's history against the ledger, and the
// harness resumes its saved session (harnessSession, or its latest). The
// sandbox belongs to the new Episode, also when RelaunchIn fails (it is
// then deleted).
func RelaunchIn(ctx context.Context, env *Env, spec Spec, sandboxID, harnessSession, ledgerTip string) (*Episode, error) {
	if err := spec.prepare(ctx); err != nil {
		return nil, err
	}
	st, err := env.Gateway.Restore(spec.name(), false, relay.LedgerAt{Tip: ledgerTip})
	if err != nil {
		return nil, fmt.Errorf("episode %s: gateway: %w", spec.name(), err)
	}
	e := &Episode{env: env, spec: spec, name: spec.name(), launch: env.launch(spec), attempt: st.Attempt}
	o := env.sessionOptions(spec, spec.Harness.Resume(e.launch, harnessSession), st.Attempt)
	o.Sandbox, o.Adopt, o.HarnessSession = sandboxID, true, harnessSession
	sess, err := checkpoint.NewSession(ctx, o)
	if err != nil {
		return nil, fmt.Errorf("episode %s: %w", spec.ID, err)
	}
	e.sess = sess
	if err := e.boot(ctx, st.Credentials(int64(st.Attempt)*callsPerAttempt+1), false); err != nil {
		_ = sess.Close(context.WithoutCancel(ctx))
		return nil, err
	}
	return e, nil
}

// ErrNotSameLaunch: a fork's supervisor is not the launch a record names
// (the snapshot did not keep it), so the episode must be relaunched.
var ErrNotSameLaunch = errors.New("the supervisor in the fork is not the recorded launch")

// ResumeInPlace continues an episode whose snapshot kept its processes: the
// supervisor in sandbox must report the recorded identity; the gateway cuts
// the ledger to the relay's delivered count and raises the attempt, the
// relay's credentials are rewritten, and `continue seq` resumes the
// harness (the relay re-issues the calls it had not delivered). On
// ErrNotSameLaunch nothing has changed and the caller relaunches instead.
func ResumeInPlace(ctx context.Context, env *Env, spec Spec, sandboxID string, rec checkpoint.State) (*Episode, error) {
	return resumeInPlace(ctx, env, spec, sandboxID, rec, "")
}

// ResumeCopy is ResumeInPlace for a second (third, ...) fork of the same
// snapshot: the copy continues as episode name, with its own gateway
// registration and a ledger that starts as a copy of the original's up to
// the relay's delivered count, so that each copy's ledger holds exactly the
// responses its harness acted on. Inside the sandbox it keeps the
// original's paths. The original's ledger is not touched.
func ResumeCopy(ctx context.Context, env *Env, spec Spec, sandboxID string, rec checkpoint.State, name string) (*Episode, error) {
	if name == "" || name == spec.name() || name == spec.ID {
		return nil, fmt.Errorf("episode %s: a copy needs a name of its own", spec.name())
	}
	return resumeInPlace(ctx, env, spec, sandboxID, rec, name)
}

// RelaunchCopy is RelaunchIn for a fork of another episode's snapshot
// where the snapshot cannot resume in place: the copy is relaunched as
// episode name, with its own gateway registration and a ledger that starts
// as a copy of the original's first upTo entries (the record's ledger
// position), against which the relaunched harness's history is matched.
// The original's ledger is not touched.
func RelaunchCopy(ctx context.Context, env *Env, spec Spec, sandboxID, harnessSession string, at relay.LedgerAt, name string) (*Episode, error) {
	if name == "" || name == spec.name() || name == spec.ID {
		_ = env.Provider.Delete(context.WithoutCancel(ctx), sandboxID)
		return nil, fmt.Errorf("episode %s: a copy needs a name of its own", spec.name())
	}
	if _, err := env.Gateway.Fork(spec.name(), name, at); err != nil {
		_ = env.Provider.Delete(context.WithoutCancel(ctx), sandboxID)
		return nil, fmt.Errorf("episode %s: copy %s at the gateway: %w", spec.name(), name, err)
	}
	spec.Name = name
	return RelaunchIn(ctx, env, spec, sandboxID, harnessSession, "")
}

// adoptLaunch gives e a session over the supervisor already running in
// sandboxID (a fork that kept the processes) and checks that it is the
// recorded launch (ErrNotSameLaunch otherwise); it returns its status.
func (e *Episode) adoptLaunch(ctx context.Context, sandboxID string, rec checkpoint.State) (*supervisor.Status, error) {
	o := e.env.sessionOptions(e.spec, e.spec.Harness.Start(e.launch), e.attempt)
	o.Sandbox, o.Adopt, o.Running, o.HarnessSession = sandboxID, true, true, rec.HarnessSession
	sess, err := checkpoint.NewSession(ctx, o)
	if err != nil {
		return nil, fmt.Errorf("episode %s: %w", e.spec.ID, err)
	}
	e.sess = sess
	st, err := sess.Status(ctx)
	if err != nil || st.Identity != rec.Identity {
		return nil, fmt.Errorf("episode %s: %w (status %+v, %v)", e.spec.ID, ErrNotSameLaunch, st, err)
	}
	return st, nil
}

func resumeInPlace(ctx context.Context, env *Env, spec Spec, sandboxID string, rec checkpoint.State, copyName string) (*Episode, error) {
	if err := spec.prepare(ctx); err != nil {
		return nil, err
	}
	name := spec.name()
	if copyName != "" {
		name = copyName
	}
	e := &Episode{env: env, spec: spec, name: name, launch: env.launch(spec), attempt: rec.Attempt}
	if _, err := e.adoptLaunch(ctx, sandboxID, rec); err != nil {
		return nil, err
	}
	sess := e.sess
	var err error
	if e.clock, err = env.setClock(ctx, sess, rec); err != nil {
		return nil, fmt.Errorf("episode %s: %w", spec.ID, err)
	}
	if copyName != "" {
		// A copy's ledger is the source's first cut entries under a hash
		// chain of its own: the source's is what must still be the
		// checkpoint's.
		if _, err := env.Gateway.Fork(spec.name(), copyName, rec.LedgerAt()); err != nil {
			return nil, fmt.Errorf("episode %s: copy %s at the gateway: %w", spec.name(), copyName, err)
		}
	}
	at := rec.LedgerAt()
	if copyName != "" {
		// The copy's ledger is the checkpoint's history already (Fork
		// checked the source's head and took its tip's entries).
		at.Head, at.Tip = "", ""
	}
	gst, err := env.Gateway.Restore(name, true, at)
	if err != nil {
		return nil, fmt.Errorf("episode %s: gateway: %w", spec.ID, err)
	}
	e.attempt = gst.Attempt
	cred := gst.Credentials(0)
	cred.Upstream = env.GatewayURL
	b, err := json.Marshal(cred)
	if err != nil {
		return nil, err
	}
	if err := env.Gateway.Bind(name, sandboxID); err != nil {
		return nil, fmt.Errorf("episode %s: bind it to sandbox %s at the gateway: %w", spec.ID, sandboxID, err)
	}
	if err := sess.WriteSecret(ctx, path.Base(tokenFile(spec.ID)), b); err != nil {
		return nil, fmt.Errorf("episode %s: write the relay's credentials: %w", spec.ID, err)
	}
	if _, err := sess.Continue(ctx, rec.PauseSeq); err != nil {
		return nil, err
	}
	return e, nil
}

// A restore that must be finished or undone after a crash continues an
// episode in two steps. The Ready functions make a fork ready to continue
// as a given attempt and touch nothing outside the fork (no gateway
// attempt, no ledger cut, no binding), so a fork that was made ready and
// never continued is undone by deleting it. Go then continues it, once
// the caller has raised the gateway to that attempt (relay.Gateway.Restore,
// which cuts the ledger of an in-place resume); Go may be repeated.

// ReadyInPlace makes sandbox, a fork of a snapshot that kept the
// episode's processes, ready to resume in place as attempt: its
// supervisor must report the recorded identity (ErrNotSameLaunch
// otherwise, and an error matching checkpoint.ErrExited when its harness
// has ended there), the guest's clock is set by the env's policy and the
// relay's credentials of attempt are written. Go continues the pause.
func ReadyInPlace(ctx context.Context, env *Env, spec Spec, sandboxID string, rec checkpoint.State, attempt int) (*Episode, error) {
	if err := spec.prepare(ctx); err != nil {
		return nil, err
	}
	e := &Episode{env: env, spec: spec, name: spec.name(), launch: env.launch(spec), attempt: attempt, resumeSeq: rec.PauseSeq}
	st, err := e.adoptLaunch(ctx, sandboxID, rec)
	if err != nil {
		return nil, err
	}
	sess := e.sess
	if st.State == supervisor.StateExited {
		return nil, fmt.Errorf("episode %s: %w: the recorded launch's harness ended in the fork before the continue", spec.ID, checkpoint.ErrExited)
	}
	if e.clock, err = env.setClock(ctx, sess, rec); err != nil {
		return nil, fmt.Errorf("episode %s: %w", spec.ID, err)
	}
	gst, err := env.Gateway.Episode(e.name)
	if err != nil {
		return nil, fmt.Errorf("episode %s: gateway: %w", spec.ID, err)
	}
	cred := gst.Credentials(0)
	cred.Attempt = attempt
	if err := e.writeCredentials(ctx, cred); err != nil {
		return nil, err
	}
	return e, nil
}

// ReadyRelaunch makes sandbox, a fork of the episode's snapshot, ready to
// relaunch its harness from its saved session (harnessSession, or its
// latest) as attempt: the harness is installed and prepared and the
// relay's credentials of attempt written. Go starts the supervisor.
// ReadyRelaunch may be repeated on the same fork.
func ReadyRelaunch(ctx context.Context, env *Env, spec Spec, sandboxID, harnessSession string, attempt int) (*Episode, error) {
	if err := spec.prepare(ctx); err != nil {
		return nil, err
	}
	gst, err := env.Gateway.Episode(spec.name())
	if err != nil {
		return nil, fmt.Errorf("episode %s: gateway: %w", spec.name(), err)
	}
	e := &Episode{env: env, spec: spec, name: spec.name(), launch: env.launch(spec), attempt: attempt}
	o := env.sessionOptions(spec, spec.Harness.Resume(e.launch, harnessSession), attempt)
	o.Sandbox, o.Adopt, o.HarnessSession = sandboxID, true, harnessSession
	sess, err := checkpoint.NewSession(ctx, o)
	if err != nil {
		return nil, fmt.Errorf("episode %s: %w", spec.ID, err)
	}
	e.sess = sess
	cred := gst.Credentials(int64(attempt)*callsPerAttempt + 1)
	cred.Attempt = attempt
	if err := e.ready(ctx, cred, false); err != nil {
		return nil, err
	}
	return e, nil
}

// Go continues an episode made ready by ReadyInPlace or ReadyRelaunch; the
// gateway must be at the episode's attempt. It binds the episode's token
// to its sandbox, then continues the pause in force (in place) or starts
// the supervisor (relaunch). A repeated continue is answered again; with
// old set (a Go that an earlier process may have sent before it died), a
// relaunch whose supervisor answers and is not the launch old is not
// started a second time.
func (e *Episode) Go(ctx context.Context, old *proc.Identity) error {
	if err := e.bind(); err != nil {
		return err
	}
	if e.resumeSeq > 0 {
		if _, err := e.sess.Continue(ctx, e.resumeSeq); err != nil {
			return fmt.Errorf("episode %s: continue %d: %w", e.spec.ID, e.resumeSeq, err)
		}
		return nil
	}
	if old != nil {
		started, err := e.sess.FindStarted(ctx, 3*time.Second, *old)
		if err != nil {
			return fmt.Errorf("episode %s: %w", e.spec.ID, err)
		}
		if started {
			return nil
		}
	}
	if err := e.sess.Start(ctx); err != nil {
		return fmt.Errorf("episode %s: %w", e.spec.ID, err)
	}
	return nil
}

// InPlace reports whether the episode resumes in place (ReadyInPlace).
func (e *Episode) InPlace() bool { return e.resumeSeq > 0 }

// Attach finds a running episode again (after a restart of the host
// process): its supervisor already runs in sandboxID.
func Attach(ctx context.Context, env *Env, spec Spec, sandboxID string, attempt int) (*Episode, error) {
	if err := spec.prepare(ctx); err != nil {
		return nil, err
	}
	if _, err := env.Provider.Get(ctx, sandboxID); err != nil {
		return nil, fmt.Errorf("episode %s: sandbox %s: %w", spec.ID, sandboxID, err)
	}
	e := &Episode{env: env, spec: spec, name: spec.name(), launch: env.launch(spec), attempt: attempt}
	o := env.sessionOptions(spec, spec.Harness.Start(e.launch), attempt)
	o.Sandbox, o.Adopt, o.Running = sandboxID, true, true
	sess, err := checkpoint.NewSession(ctx, o)
	if err != nil {
		return nil, fmt.Errorf("episode %s: %w", spec.ID, err)
	}
	e.sess = sess
	return e, nil
}

// Spec is the episode's spec.
func (e *Episode) Spec() Spec { return e.spec }

// Close ends the episode and deletes its sandbox.
func (e *Episode) Close(ctx context.Context) error { return e.sess.Close(ctx) }
