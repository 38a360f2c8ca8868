package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"stasis/internal/control/model"
	"stasis/internal/control/relay"
)

// RelayOptions configure Relay.
type RelayOptions struct {
	// Concurrency levels for the throughput runs (default 1, 64, 512).
	Concurrency []int
	// Calls per latency sample (default 2000) and per throughput run
	// (default 4000).
	LatencyCalls, ThroughputCalls int
	// TokenDelay is the scripted model's time per generated token (default
	// 0: the model answers at once, the hardest case for the relay).
	TokenDelay time.Duration
	Dir        string // state directory (default: a temporary one, removed after)
	Progress   io.Writer
	// Phase, when set, is called as each part of the measurement starts
	// ("latency", then "direct/C" and "relayed/C" for each concurrency C);
	// the function it returns, if any, is called as that part ends. A
	// profile of one part hangs on it.
	Phase func(name string) (end func())
}

// RelayRow is the throughput at one concurrency.
type RelayRow struct {
	Concurrency int     `json:"concurrency"`
	Direct      float64 `json:"direct_calls_per_s"`
	Relayed     float64 `json:"relayed_calls_per_s"`
	Ratio       float64 `json:"relayed_over_direct"`
	// CPU time of this process (user and system: callers, relays, gateway
	// and model together) per call, in microseconds, over each run.
	DirectCPU  float64 `json:"direct_cpu_us_per_call"`
	RelayedCPU float64 `json:"relayed_cpu_us_per_call"`
}

// RelayResult is the latency a call gains through relay and gateway, and
// the throughput with and without them, measured in the same run.
type RelayResult struct {
	Direct   Latency       `json:"direct"`
	Relayed  Latency       `json:"relayed"`
	AddedP50 time.Duration `json:"added_p50_ns"`
	AddedP99 time.Duration `json:"added_p99_ns"`
	Rows     []RelayRow    `json:"throughput"`
}

func serve(h http.Handler) (string, func(), error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	srv := &http.Server{Handler: h}
	go func() { _ = srv.Serve(ln) }()
	return "http://" + ln.Addr().String(), func() { _ = srv.Close() }, nil
}

// serveUnix serves h on a unix socket at path and returns its URL as a
// relay's upstream (unix://PATH).
func serveUnix(h http.Handler, path string) (string, func(), error) {
	ln, err := net.Listen("unix", path)
	if err != nil {
		return "", nil, err
	}
	srv := &http.Server{Handler: h}
	go func() { _ = srv.Serve(ln) }()
	return "unix://" + path, func() { _ = srv.Close() }, nil
}

// Relay measures the path harness → relay → gateway (ledger fsync per call)
// → scripted model against harness → model directly, in this process:
// harness to relay and gateway to model over loopback TCP, relay to gateway
// over a unix socket (as a sandbox's relay reaches the gateway). Each
// concurrent caller is its own episode with its own relay and ledger, as in
// training.
func Relay(ctx context.Context, o RelayOptions) (RelayResult, error) {
	var res RelayResult
	if len(o.Concurrency) == 0 {
		o.Concurrency = []int{1, 64, 512}
	}
	if o.LatencyCalls <= 0 {
		o.LatencyCalls = 2000
	}
	if o.ThroughputCalls <= 0 {
		o.ThroughputCalls = 4000
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	dir, remove, err := dirOr(o.Dir, "stasis-bench-relay-")
	if err != nil {
		return res, err
	}
	defer remove()
	b, err := newRelayBench(o, dir)
	if err != nil {
		return res, err
	}
	defer b.close()
	if err := b.latency(&res); err != nil {
		return res, err
	}
	// Throughput at each concurrency.
	for _, c := range o.Concurrency {
		fmt.Fprintf(o.Progress, "relay: throughput at %d concurrent calls ...\n", c)
		d, dcpu, err := b.throughput(ctx, c, false)
		if err != nil {
			return res, err
		}
		r, rcpu, err := b.throughput(ctx, c, true)
		if err != nil {
			return res, err
		}
		res.Rows = append(res.Rows, RelayRow{Concurrency: c, Direct: d, Relayed: r, Ratio: r / d, DirectCPU: dcpu, RelayedCPU: rcpu})
	}
	return res, ctx.Err()
}

// relayBench is what Relay measures: the scripted model, the gateway and
// a relay per caller, all served in this process.
type relayBench struct {
	o        RelayOptions
	modelURL string
	relays   []string // a relay's URL per caller
	client   *http.Client
	next     int      // the number of the next call of each caller
	stops    []func() // close stops them, last first
}

// newRelayBench serves the model, the gateway and a relay per caller of
// the highest concurrency, each its own episode.
func newRelayBench(o RelayOptions, dir string) (b *relayBench, err error) {
	b = &relayBench{o: o, client: &http.Client{Transport: &http.Transport{MaxIdleConns: 4096, MaxIdleConnsPerHost: 1024}}}
	defer func() {
		if err != nil {
			b.close()
		}
	}()
	modelURL, stopModel, err := serve(model.New(model.Options{TokenDelay: o.TokenDelay}).Handler())
	if err != nil {
		return nil, err
	}
	b.modelURL, b.stops = modelURL, append(b.stops, stopModel)
	g, err := relay.OpenGateway(relay.GatewayConfig{Upstream: modelURL, State: filepath.Join(dir, "gateway")})
	if err != nil {
		return nil, err
	}
	b.stops = append(b.stops, func() { g.Close() })
	// Relays reach the gateway over a unix socket, as in a sandbox (the
	// socket's directory is bound into it); the socket lives in a directory
	// of its own, as a path under Dir may be too long for one.
	sockDir, err := os.MkdirTemp("", "stasis-bench-gw-")
	if err != nil {
		return nil, err
	}
	b.stops = append(b.stops, func() { os.RemoveAll(sockDir) })
	gwURL, stopGW, err := serveUnix(g.Handler(), filepath.Join(sockDir, "gateway.sock"))
	if err != nil {
		return nil, err
	}
	b.stops = append(b.stops, stopGW)

	maxC := 1
	for _, c := range o.Concurrency {
		maxC = max(maxC, c)
	}
	b.relays = make([]string, maxC)
	for i := range b.relays {
		ep, err := g.AddEpisode(fmt.Sprintf("bench-%d", i))
		if err != nil {
			return nil, err
		}
		tok := filepath.Join(dir, fmt.Sprintf("token-%d.json", i))
		j, _ := json.Marshal(ep.Credentials(0))
		if err := os.WriteFile(tok, j, 0o600); err != nil {
			return nil, err
		}
		r, err := relay.New(relay.Config{Upstream: gwURL, TokenFile: tok})
		if err != nil {
			return nil, err
		}
		u, stop, err := serve(r.Handler())
		if err != nil {
			return nil, err
		}
		b.stops = append(b.stops, stop)
		b.relays[i] = u
	}
	return b, nil
}

func (b *relayBench) close() {
	for i := len(b.stops) - 1; i >= 0; i-- {
		b.stops[i]()
	}
}

// call makes call n of a caller to base. Each caller's conversation grows
// by one turn per call (its own messages), so every call is distinct and
// the scripted model answers with a tool call or text as the turn says.
func (b *relayBench) call(base string, caller, n int) (time.Duration, error) {
	body := fmt.Sprintf(`{"model":"stasis-scripted","messages":[{"role":"user","content":"caller %d call %d: fix the bug"}]}`, caller, n)
	t0 := time.Now()
	resp, err := b.client.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader([]byte(body)))
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		return 0, fmt.Errorf("status %d from %s", resp.StatusCode, base)
	}
	return time.Since(t0), nil
}

// phase tells Options.Phase that the part name starts; the function it
// returns tells that it ends.
func (b *relayBench) phase(name string) func() {
	if b.o.Phase != nil {
		if end := b.o.Phase(name); end != nil {
			return end
		}
	}
	return func() {}
}

// latency measures one caller, its direct and relayed calls interleaved
// so both see the same machine.
func (b *relayBench) latency(res *RelayResult) error {
	fmt.Fprintf(b.o.Progress, "relay: latency, %d calls each way ...\n", b.o.LatencyCalls)
	endPhase := b.phase("latency")
	var direct, relayed []time.Duration
	for i := 0; i < b.o.LatencyCalls; i++ {
		d, err := b.call(b.modelURL, 0, i)
		if err != nil {
			return err
		}
		r, err := b.call(b.relays[0], 0, i)
		if err != nil {
			return err
		}
		direct, relayed = append(direct, d), append(relayed, r)
	}
	endPhase()
	res.Direct, res.Relayed = summarise(direct), summarise(relayed)
	res.AddedP50, res.AddedP99 = res.Relayed.P50-res.Direct.P50, res.Relayed.P99-res.Direct.P99
	b.next = b.o.LatencyCalls
	return nil
}

// throughput measures c concurrent callers, through the relays (via) or
// directly: calls per second, and this process's CPU time per call.
func (b *relayBench) throughput(ctx context.Context, c int, via bool) (rate, cpuPerCall float64, err error) {
	var done atomic.Int64
	var wg sync.WaitGroup
	var firstErr error
	var mu sync.Mutex
	fail := func(err error) {
		mu.Lock()
		firstErr = err
		mu.Unlock()
	}
	per := b.o.ThroughputCalls / c
	if per < 1 {
		per = 1
	}
	name := "direct/"
	if via {
		name = "relayed/"
	}
	// One untimed call per caller first, so the timed rounds measure
	// the steady state: every connection on the path open, every
	// goroutine serving it started, every ledger written once. Both
	// ways get it.
	next := b.next
	start := make(chan struct{})
	var warm sync.WaitGroup
	warm.Add(c)
	for k := 0; k < c; k++ {
		wg.Add(1)
		go func(k int) {
			defer wg.Done()
			base := b.modelURL
			if via {
				base = b.relays[k]
			}
			_, err := b.call(base, k, next)
			warm.Done()
			if err != nil {
				fail(err)
				return
			}
			<-start
			for i := 1; i <= per; i++ {
				if ctx.Err() != nil {
					return
				}
				if _, err := b.call(base, k, next+i); err != nil {
					fail(err)
					return
				}
				done.Add(1)
			}
		}(k)
	}
	warm.Wait()
	endPhase := b.phase(name + strconv.Itoa(c))
	t0, cpu0 := time.Now(), processCPU()
	close(start)
	wg.Wait()
	took, cpu := time.Since(t0), processCPU()-cpu0
	endPhase()
	b.next += per + 1
	if firstErr != nil {
		return 0, 0, firstErr
	}
	n := float64(done.Load())
	return n / took.Seconds(), float64(cpu.Microseconds()) / n, nil
}

// processCPU is the CPU time this process has used (user and system).
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
