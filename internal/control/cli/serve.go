package cli

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strings"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"stasis/internal/control/cluster"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/serve"
	"stasis/internal/control/server"
	"stasis/internal/control/system"
	"stasis/internal/control/task"
	"stasis/internal/providers/microvm"
	"stasis/internal/providers/sim"
	"stasis/sandbox"
)

// selfEnv is the environment this binary runs with that copies of it
// placed in sandboxes need too: STASIS_TEST_AS_CLI makes a test binary act
// as stasis (stasistest), and GORACE sets a race-enabled binary's detector
// (the tests turn off its one-second sleep at exit).
func selfEnv() map[string]string {
	env := map[string]string{}
	for _, k := range []string{"STASIS_TEST_AS_CLI", "GORACE"} {
		if v, ok := os.LookupEnv(k); ok {
			env[k] = v
		}
	}
	return env
}

// StoreEnv is the environment variable that names the shared store when
// --store is not given.
const StoreEnv = "STASIS_STORE"

// BlobsEnv is the environment variable that names the shared blob store
// when --blobs is not given.
const BlobsEnv = "STASIS_BLOBS"

// serveFlags are serve's flags.
type serveFlags struct {
	listen, state, storeURL, tasksSpec, repos, envs, upstream, keyEnv string
	modelName, node, nodeAddr, blobs                                  string
	nodeLease                                                         time.Duration
	concurrency                                                       int
	logFormat, logLevel                                               string
	provider, guestBinary, guestMemory, clockPolicy, gwListen, gwURL  string
	access                                                            server.AccessOptions
	stragglers, imageRef                                              string
	pullImages                                                        bool
	limits                                                            limitFlags
	gate                                                              *serve.StepGate // STASIS_STEP_GATE's, for tests
}

func newServeCmd() *cobra.Command {
	var sf serveFlags
	cmd := &cobra.Command{
		Use:     "serve --listen ADDR --state DIR [--api-token-file FILE] [--tls-cert F --tls-key F [--tls-client-ca F]] [--tasks builtin|DIR|FILE.jsonl] [--model-upstream URL] [--concurrency N]",
		Short:   "Serve the environment API: episodes, checkpoints, metrics",
		Long:    serveLong,
		Example: serveExample,
		Args:    cobra.NoArgs,
		RunE:    func(cmd *cobra.Command, _ []string) error { return sf.run(cmd) },
	}
	sf.add(cmd.Flags())
	return cmd
}

func (sf *serveFlags) add(f *pflag.FlagSet) {
	f.StringVar(&sf.listen, "listen", "", "address to serve on: host:port or unix:/path (anything but loopback or a unix socket needs --api-token-file or --tls-client-ca)")
	f.StringVar(&sf.access.TokenFile, "api-token-file", "", "bearer tokens the API accepts, one a line (blank and # lines ignored); every request but /healthz then needs Authorization: Bearer TOKEN")
	f.StringArrayVar(&sf.access.Hosts, "api-host", nil, "a Host name the API answers to, NAME or NAME:PORT (repeatable; default: loopback names on loopback, else the listen address or, for 0.0.0.0 and [::], this machine's addresses and host name)")
	f.StringVar(&sf.access.TLSCert, "tls-cert", "", "serve the API over TLS with this certificate chain (PEM; with --tls-key)")
	f.StringVar(&sf.access.TLSKey, "tls-key", "", "the private key of --tls-cert (PEM)")
	f.StringVar(&sf.access.TLSClientCA, "tls-client-ca", "", "require a client certificate signed by this CA (PEM) on every connection (with --tls-cert)")
	f.StringVar(&sf.provider, "provider", "local", "sandbox provider: local (bubblewrap; stop pauses, relaunch on restore), microvm (QEMU; hold pauses, resume in place), opensandbox (OPENSANDBOX_URL, OPENSANDBOX_API_KEY; stop pauses, relaunch) or e2b (E2B_API_KEY, E2B_DOMAIN; hold pauses, resume in place; with E2B_FILE_ONLY_SNAPSHOTS=1 stop pauses, relaunch), or "+sim.Help)
	f.StringVar(&sf.gwListen, "gateway-listen", "", "hosted providers: a TCP address where the gateway also listens for the sandboxes' relays")
	f.StringVar(&sf.gwURL, "gateway-url", "", "hosted providers: the gateway's URL as the sandboxes reach it (default: http:// and the --gateway-listen address)")
	f.StringVar(&sf.guestMemory, "guest-memory", "", fmt.Sprintf("microvm: each guest's memory, e.g. 1GiB (default %d MiB)", microvm.DefaultMemMiB))
	f.StringVar(&sf.guestBinary, "guest-binary", "", "microvm: the static stasis binary for the guest image (default: this binary, which must be static)")
	f.StringVar(&sf.clockPolicy, "clock-policy", "continuous", "microvm: a guest's wall clock after a resume in place: continuous (pause wall + uptime since) or host")
	f.StringVar(&sf.state, "state", "", "state directory: store.db, gateway/ and local/ (made if missing)")
	f.StringVar(&sf.node, "node", "", "this server's name among several sharing one --store (PostgreSQL): it joins the cluster with a lease renewed as its heartbeat, drives its own episodes, and takes its share of every checkpoint any node begins")
	f.StringVar(&sf.nodeAddr, "node-addr", "", "with --node: this server's API as the other nodes and trainers reach it, e.g. http://10.0.0.5:8080 (default: the --listen address)")
	f.DurationVar(&sf.nodeLease, "node-lease", cluster.DefaultLease, "with --node: how long the node's lease lasts without a heartbeat; a node silent for longer fails the checkpoints it was preparing and may write nothing more")
	f.StringVar(&sf.blobs, "blobs", "", "local and microvm providers: keep the snapshots in S3 at s3://BUCKET/PREFIX (endpoint and credentials from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION), so that every node of a cluster forks every node's snapshots (default: $"+BlobsEnv+", else in --state)")
	f.StringVar(&sf.storeURL, "store", "", "where the checkpoint records, the episodes and the ledgers are kept: a postgres://USER@HOST:PORT/DATABASE URL (password in the URL or PGPASSWORD) for a database that several servers share (default: $"+StoreEnv+", else SQLite and files in --state)")
	f.StringVar(&sf.tasksSpec, "tasks", "builtin", "the tasks episodes may name: builtin, a task directory, or SWE-bench JSONL with --repos")
	f.StringVar(&sf.repos, "repos", "", "the directory of git clones (or bundles) a SWE-bench --tasks file refers to")
	addEnvsFlag(f, &sf.envs)
	f.StringVar(&sf.upstream, "model-upstream", "", "the model server the gateway forwards to (default: the scripted model, in-process)")
	f.StringVar(&sf.keyEnv, "model-key-env", "STASIS_MODEL_KEY", "environment variable holding the model server's API key, if it needs one")
	f.StringVar(&sf.modelName, "model", "", "the model name harnesses ask for (default: the scripted model's)")
	f.StringVar(&sf.stragglers, "stragglers", "exclude", "a checkpoint's episode that cannot be paused or snapshotted: exclude (commit without it, named with the reason in the answer) or fail (fail the checkpoint, naming it); a request's \"stragglers\" overrides it")
	sf.limits.add(f)
	f.StringVar(&sf.imageRef, "image", "", "the sandboxes' image where neither the start request nor the task names one: oci:PATH[:TAG], docker-archive:PATH, docker://HOST/REPO:TAG or sha256:HEX on the local provider (pulled at start), the service's template name on e2b and opensandbox (default: the provider's own root)")
	f.BoolVar(&sf.pullImages, "pull-images", false, "a restore whose records name an image no longer on this host pulls it again from the reference it was pulled as (default: refuse, saying how to pull it)")
	f.IntVar(&sf.concurrency, "concurrency", 64, "episodes a checkpoint or a restore works on at once")
	f.StringVar(&sf.logFormat, "log-format", "text", "log format on stderr: text or json")
	f.StringVar(&sf.logLevel, "log-level", "info", "log level: debug, info, warn or error")
}

// run serves the API until a signal.
func (sf *serveFlags) run(cmd *cobra.Command) error {
	// Signals are caught from the start: one that comes while the server
	// starts ends it in order once it has started.
	sigCtx, stopSignals := serve.OnSignal(cmd.Context())
	defer stopSignals()
	serve.ProcsForFsync() // the gateway fsyncs each ledger entry
	log, o, err := sf.options()
	if err != nil {
		return err
	}
	ln, shown, err := serve.Listen(sf.listen)
	if err != nil {
		return &exitError{Code: 1, Err: fmt.Errorf("--listen: %w", err)}
	}
	sf.access.Logger = log
	if o.Node != "" && o.NodeAddr == "" {
		o.NodeAddr = shownURL(shown, sf.access.TLSCert != "")
	}
	if o.Access, err = server.NewAccess(ln.Addr(), sf.access); err != nil {
		_ = ln.Close()
		return &exitError{Code: 2, Err: err}
	}
	ln = o.Access.Listener(ln)
	srv, err := server.New(cmd.Context(), o)
	if err != nil {
		_ = ln.Close()
		return &exitError{Code: 1, Err: err}
	}
	if os.Getenv(HeapProfileEnv) != "" {
		stop := heapProfileOnSignal(filepath.Join(sf.state, "heap.pb.gz"), log)
		defer stop()
	}
	if os.Getenv(CPUProfileEnv) != "" {
		stop := cpuProfileOnSignal(filepath.Join(sf.state, "cpu.pb.gz"), log)
		defer stop()
	}
	if sf.gate != nil {
		_ = sf.gate.Step("serve", "listening", "")
	}
	fmt.Fprintln(cmd.OutOrStdout(), shown)
	log.Info("serving", "addr", shown, "tls", o.Access.TLSConfig() != nil, "authenticates", o.Access.Authenticates())
	err = serve.UntilSignal(sigCtx, ln, srv.Handler(), log)
	if cerr := srv.Close(); cerr != nil {
		log.Warn("closing the server", "err", cerr)
	}
	if err != nil {
		return &exitError{Code: 1, Err: err}
	}
	return nil
}

// shownURL is the URL of the API served at shown (host:port or unix:PATH).
func shownURL(shown string, tls bool) string {
	if strings.HasPrefix(shown, "unix:") {
		return shown
	}
	if tls {
		return "https://" + shown
	}
	return "http://" + shown
}

// options checks the flags, loads the tasks and makes the server's
// options (all but Access) and its logger.
func (sf *serveFlags) options() (*slog.Logger, server.Options, error) {
	if sf.listen == "" {
		return nil, server.Options{}, &exitError{Code: 2, Err: errors.New("--listen is required: host:port (port 0 picks one) or unix:/path")}
	}
	if sf.state == "" {
		return nil, server.Options{}, &exitError{Code: 2, Err: errors.New("--state is required: the directory that holds the store, the gateway and the sandboxes")}
	}
	if sf.concurrency < 1 {
		return nil, server.Options{}, &exitError{Code: 2, Err: fmt.Errorf("--concurrency %d: give at least 1", sf.concurrency)}
	}
	log, err := newLogger(sf.logFormat, sf.logLevel)
	if err != nil {
		return nil, server.Options{}, &exitError{Code: 2, Err: err}
	}
	if sf.storeURL == "" {
		sf.storeURL = os.Getenv(StoreEnv)
	}
	if sf.blobs == "" {
		sf.blobs = os.Getenv(BlobsEnv)
	}
	lo, err := taskOptions(sf.repos, sf.envs, log)
	if err != nil {
		return nil, server.Options{}, &exitError{Code: 2, Err: err}
	}
	if sf.provider != "" && sf.provider != "local" && lo.Envs != "" {
		// Environments are built on this host; only local
		// sandboxes can see them.
		log.Warn("SWE-bench environments are built for local sandboxes only: the tests run with the sandbox's own Python", "provider", sf.provider)
		lo.Envs = ""
	}
	ts, problems, err := task.Load(sf.tasksSpec, lo)
	if err != nil {
		return nil, server.Options{}, &exitError{Code: 2, Err: err}
	}
	for _, p := range problems {
		log.Warn("task not loaded", "err", p)
	}
	if len(ts) == 0 {
		return nil, server.Options{}, &exitError{Code: 2, Err: fmt.Errorf("--tasks %s: no task loaded", sf.tasksSpec)}
	}
	if err := coordinator.CheckStragglers(sf.stragglers); err != nil {
		return nil, server.Options{}, &exitError{Code: 2, Err: fmt.Errorf("--%w", err)}
	}
	lim, err := sf.limits.parse()
	if err != nil {
		return nil, server.Options{}, &exitError{Code: 2, Err: err}
	}
	if lim != (sandbox.Limits{}) && sf.provider != "" && sf.provider != "local" {
		return nil, server.Options{}, &exitError{Code: 2, Err: fmt.Errorf("the limit flags are for the local provider: the %s provider's sandboxes are sized by the service or the VM", sf.provider)}
	}
	guestMiB, err := parseGuestMemory(sf.guestMemory, sf.provider)
	if err != nil {
		return nil, server.Options{}, &exitError{Code: 2, Err: err}
	}
	gate, err := serve.StepGateFromEnv(log)
	if err != nil {
		return nil, server.Options{}, &exitError{Code: 2, Err: err}
	}
	sf.gate = gate
	var coOpts func(*coordinator.Options)
	var snapHook func(string) error
	if gate != nil {
		coOpts = func(o *coordinator.Options) { coordinator.SetStepHook(o, gate.Step) }
		snapHook = gate.Snapshot
	}
	return log, server.Options{Config: system.Config{
		CoordinatorOptions: coOpts, SnapshotHook: snapHook,
		GuestMemMiB: guestMiB, Stragglers: sf.stragglers, Limits: lim, Image: sf.imageRef, PullImages: sf.pullImages,
		State: sf.state, Store: sf.storeURL, Blobs: sf.blobs, Node: sf.node, NodeAddr: sf.nodeAddr, NodeLease: sf.nodeLease, Tasks: ts, ModelUpstream: sf.upstream, ModelKey: os.Getenv(sf.keyEnv), Model: sf.modelName,
		Concurrency: sf.concurrency, Logger: log, BinaryEnv: selfEnv(),
		Provider: sf.provider, GuestBinary: sf.guestBinary, ClockPolicy: sf.clockPolicy,
		GatewayListen: sf.gwListen, GatewayURL: sf.gwURL, Envs: lo.Envs,
	}}, nil
}

const serveLong = `serve is the environment server: an HTTP JSON API for trainers.

  POST   /v1/episodes                   start {"task", "harness": "mini|opencode"} (201); the id of a
                                        retired or lost episode starts it again as its next attempt
  GET    /v1/episodes                   list (?state=running|ended|retired|lost&task=T&harness=H)
  GET    /v1/episodes/ID                one episode: its record, supervisor status, ledger, reward
  POST   /v1/episodes/ID/verify         run the task's tests once the harness ended (capture once)
  POST   /v1/episodes/ID/retire         delete its sandbox
  POST   /v1/checkpoints                pause, snapshot and record every live episode, commit (201)
  GET    /v1/checkpoints[/ID]           list, or one with its records
  POST   /v1/checkpoints/ID/restore     fork, resume in place or relaunch; all or nothing
  POST   /v1/checkpoints/ID/branch      {"episode", "copies"?: N}: one episode as N new ones (201)
  DELETE /v1/checkpoints/ID             delete it and the snapshots no other one names
  GET    /metrics (the server's and the gateway's), /healthz, /openapi.json

Errors are {"error": {"type", "message"}} with 400 (bad JSON, unknown field,
bad value), 401 (no or a wrong bearer token), 403 (a cross-origin request
from a browser), 404 (unknown episode or checkpoint), 409 (exists, wrong
state), 413 (body over 1 MiB), 415 (a POST not sent as Content-Type:
application/json, even with no body), 421 (a Host header the server does not
answer to) or 500.

Who may call it. ADDR on loopback (127.0.0.1, [::1], localhost) or a unix
socket needs no credentials; on loopback the Host header must be a loopback
name (localhost, 127.0.0.1, [::1], any port), against DNS rebinding. Any
other ADDR (0.0.0.0, [::], a LAN address) is refused unless the API
authenticates: --api-token-file FILE holds bearer tokens, one a line (blank
lines and lines starting with # ignored; each at least 16 characters, e.g.
openssl rand -hex 32), and every request but GET /healthz then needs
"Authorization: Bearer TOKEN"; --tls-cert and --tls-key serve TLS, and
--tls-client-ca requires a client certificate signed by that CA (which alone
also authenticates, for node-to-node traffic). A networked server answers to
the Host names --api-host gives (NAME any port, NAME:PORT that port), by
default its listen address, or for 0.0.0.0 and [::] this machine's
addresses, host name and the loopback names. The gateway is never on the
API's address: relays reach it on its socket (or --gateway-listen).

DIR (--state, made if missing) holds everything durable: the record store
(DIR/store.db), the gateway's episodes and ledgers (DIR/gateway) and the
provider's sandboxes and snapshots (DIR/local or DIR/microvm). The relay
inside each sandbox reaches the gateway on a unix socket of that sandbox's
own, /tmp/stasis-gw-HASH/SANDBOX/gw.sock (HASH the same for every server on
DIR), bound read-only into a local sandbox at /stasis/gateway/gw.sock and
forwarded by QEMU into a microVM guest at 10.0.2.100:80; an episode's token
is valid on its own sandbox's socket only, and no longer once it is retired.

Limits (local provider). Each sandbox has a control group with a pids limit
(--pids-limit), a memory and swap limit (--memory-limit) and a CPU weight
(--cpu-weight), a /dev/shm of --shm-size, and its writable places' disk use
counted against --disk-limit; an episode may ask for its own in its start
request ("limits": {"pids", "memory_bytes", "cpu_weight", "shm_bytes",
"disk_bytes"}). A sandbox over a limit is ended and its episode reports why;
the other sandboxes go on.

Stragglers. A checkpoint's episode that cannot be paused or snapshotted (its
supervisor refuses the pause, its sandbox fails) is by default left out:
the checkpoint commits without it, and its answer lists it with
"excluded": true and the reason; the next checkpoint tries it again.
--stragglers fail (or "stragglers": "fail" in the request) fails the
checkpoint instead (409, naming the episode).

With --provider microvm, episodes pause by hold (the relay holds the model
calls; the harness is not signalled), a checkpoint saves each whole VM, and a
restore resumes each episode in place in its fork, with the guest's wall
clock set by --clock-policy; a fork whose supervisor is not the recorded
launch is relaunched instead, and the restore says why.

With --provider opensandbox the sandboxes are the OpenSandbox server's at
OPENSANDBOX_URL (OPENSANDBOX_API_KEY its key): their relays reach the gateway
at --gateway-listen (or --gateway-url), stasis is copied into each, pauses
stop the harness and a restore relaunches it.

With --provider e2b the sandboxes are E2B's (hosted Firecracker microVMs),
reached as E2B's SDKs are configured: E2B_API_KEY (the team's key, required),
E2B_DOMAIN (default e2b.app), E2B_API_URL (the REST API, default
https://api.$E2B_DOMAIN) and E2B_SANDBOX_URL (one address for every
sandbox's envd, routed by header). As with opensandbox their relays reach the
gateway at --gateway-listen (or --gateway-url) and stasis is copied into
each. E2B's snapshots keep the processes, so episodes pause by hold and a
restore resumes them in place; for an E2B-compatible service whose
snapshots keep files only (no memory snapshots), set
E2B_FILE_ONLY_SNAPSHOTS=1: pauses then stop the harness and a restore
relaunches it.

Without --model-upstream the server runs the scripted model in-process,
solving the tasks it loaded; with it the gateway forwards the model calls
there.

ADDR is host:port (port 0 picks a free port) or unix:/path. Once serving,
serve prints the address on stdout, one line, and serves until SIGTERM or
SIGINT; then it stops and leaves the sandboxes running. Started again on the
same DIR (also after a crash), it finds its running episodes again and goes
on serving them; an episode whose sandbox is gone is marked lost, for a
restore to bring back.

A session with curl (jq for the fields; --json sends Content-Type:
application/json, which every POST needs):

  stasis serve --listen 127.0.0.1:8080 --state /var/lib/stasis &
  curl -s --json '{"id":"ep-1","task":"py-ini-value-with-equals","harness":"mini"}' localhost:8080/v1/episodes
  curl -s localhost:8080/v1/episodes/ep-1 | jq .status.state      # running ... exited
  curl -s --json '{"id":"ckpt-1"}' localhost:8080/v1/checkpoints
  # a crash takes the server and the sandboxes; started again, ep-1 is lost
  curl -s --json '' localhost:8080/v1/checkpoints/ckpt-1/restore
  curl -s --json '' localhost:8080/v1/episodes/ep-1/verify | jq .verdict.reward   # once exited
  curl -s --json '' localhost:8080/v1/episodes/ep-1/retire

On the network, with tokens and TLS:

  stasis serve --listen 0.0.0.0:8443 --state /var/lib/stasis --api-token-file /etc/stasis/tokens \
    --tls-cert node.pem --tls-key node-key.pem --api-host stasis-1.internal
  curl -s -H "Authorization: Bearer $(head -1 /etc/stasis/tokens)" https://stasis-1.internal:8443/v1/episodes

Exit status: 0 after a signal; 2 a usage error (also a networked ADDR
without authentication, or a bad token file or certificate); 1 the server
could not start or failed.`

const serveExample = `  stasis serve --listen 127.0.0.1:8080 --state /var/lib/stasis
  stasis serve --listen unix:/run/stasis/api.sock --state /var/lib/stasis
  stasis serve --listen 10.0.0.5:8443 --state /var/lib/stasis --api-token-file tokens --tls-cert node.pem --tls-key node-key.pem --tls-client-ca nodes-ca.pem
  stasis serve --listen 127.0.0.1:0 --state ./state --tasks swe.jsonl --repos ~/clones --model-upstream http://127.0.0.1:8000`

// parseGuestMemory reads --guest-memory: a size of at least 128 MiB, for
// the microvm provider only; 0 when not given.
func parseGuestMemory(v, provider string) (int, error) {
	if v == "" {
		return 0, nil
	}
	if provider != microvm.Name {
		return 0, fmt.Errorf("--guest-memory is for the microvm provider (--provider microvm)")
	}
	n, err := humanize.ParseBytes(v)
	if err != nil || n < 128<<20 || n > 1<<40 {
		return 0, fmt.Errorf("--guest-memory %q: give a size from 128MiB, such as 512MiB or 1GiB", v)
	}
	return int(n >> 20), nil
}

// HeapProfileEnv, set in a server's environment, has it write its heap
// profile (go tool pprof) to STATE/heap.pb.gz on each SIGUSR1, then
// STATE/heap.pb.gz.done: how `stasis bench cluster --heap-profile` looks
// into a node.
const HeapProfileEnv = "STASIS_HEAP_PROFILE_SIGNAL"

// StepGateEnv, set in a server's environment to a directory, has it stop
// once at the step StepGateAtEnv names (OP:STEP[:EPISODE]) of a
// checkpoint, a restore or a provider's snapshot, marking it reached with
// a file there and going on when the test writes the matching .go file
// (serve.StepGateEnv): how the kill matrix kills a party at exactly that
// step. For tests only.
const StepGateEnv = serve.StepGateEnv

// CPUProfileEnv, set in a server's environment, has it start profiling
// its CPU (go tool pprof) into STATE/cpu.pb.gz on a SIGUSR2 and end the
// profile on the next, then write STATE/cpu.pb.gz.done: how `stasis bench
// cluster --cpu-profile` looks into a node during a checkpoint.
const CPUProfileEnv = "STASIS_CPU_PROFILE_SIGNAL"

// cpuProfileOnSignal starts and ends a CPU profile into dst on
// alternate SIGUSR2s until the returned function is called.
func cpuProfileOnSignal(dst string, log *slog.Logger) (stop func()) {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGUSR2)
	done := make(chan struct{})
	var f *os.File
	end := func() {
		if f == nil {
			return
		}
		pprof.StopCPUProfile()
		err := f.Close()
		f = nil
		if err == nil {
			err = os.WriteFile(dst+".done", nil, 0o644)
		}
		if err != nil {
			log.Warn("cpu profile", "path", dst, "err", err)
		}
	}
	go func() {
		defer end()
		for {
			select {
			case <-ch:
			case <-done:
				return
			}
			if f != nil {
				end()
				continue
			}
			_ = os.Remove(dst + ".done")
			var err error
			if f, err = os.Create(dst); err == nil {
				if err = pprof.StartCPUProfile(f); err != nil {
					_ = f.Close()
					f = nil
				}
			}
			if err != nil {
				log.Warn("cpu profile", "path", dst, "err", err)
			}
		}
	}()
	return func() { signal.Stop(ch); close(done) }
}

// heapProfileOnSignal writes the heap profile to dst on each SIGUSR1
// until the returned function is called.
func heapProfileOnSignal(dst string, log *slog.Logger) (stop func()) {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGUSR1)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-ch:
			case <-done:
				return
			}
			runtime.GC()
			_ = os.Remove(dst + ".done")
			f, err := os.Create(dst)
			if err == nil {
				err = pprof.Lookup("heap").WriteTo(f, 0)
				if cerr := f.Close(); err == nil {
					err = cerr
				}
			}
			if err == nil {
				err = os.WriteFile(dst+".done", nil, 0o644)
			}
			if err != nil {
				log.Warn("heap profile", "path", dst, "err", err)
			}
		}
	}()
	return func() { signal.Stop(ch); close(done) }
}
