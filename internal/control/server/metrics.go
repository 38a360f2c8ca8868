package server

import (
	"context"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"stasis/internal/control/serve"
	"stasis/internal/storage/store"
)

// metrics are the server's Prometheus metrics, served at GET /metrics
// with the gateway's (stasis_gateway_*).
type metrics struct {
	reg               *prometheus.Registry
	requests          *prometheus.CounterVec
	requestSeconds    *prometheus.HistogramVec
	checkpoints       *prometheus.CounterVec
	checkpointSeconds prometheus.Histogram
	restores          *prometheus.CounterVec
	restoreSeconds    prometheus.Histogram
}

func newMetrics(s *Server) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stasis_server_requests_total", Help: "Requests answered, by route and status code.",
		}, []string{"route", "code"}),
		requestSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "stasis_server_request_seconds", Help: "Time to answer a request, by route and status code.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18),
		}, []string{"route", "code"}),
		checkpoints: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stasis_server_checkpoints_total", Help: "Checkpoints taken, by result (committed or failed).",
		}, []string{"result"}),
		checkpointSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "stasis_server_checkpoint_seconds", Help: "Time to take a checkpoint (prepare, commit, continue).",
			Buckets: prometheus.ExponentialBuckets(0.05, 2, 14),
		}),
		restores: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "stasis_server_restores_total", Help: "Restores, by result (restored or failed).",
		}, []string{"result"}),
		restoreSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "stasis_server_restore_seconds", Help: "Time to restore a checkpoint (validate, fork, resume).",
			Buckets: prometheus.ExponentialBuckets(0.05, 2, 14),
		}),
	}
	live := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "stasis_server_live_episodes", Help: "Episodes this server drives.",
	}, func() float64 {
		if s.coord == nil {
			return 0
		}
		return float64(len(s.coord.LiveIDs()))
	})
	// The process's own (process_resident_memory_bytes,
	// process_open_fds, ...) and the Go runtime's (go_goroutines,
	// go_memstats_*): what an operator watches a long-running server by.
	m.reg.MustRegister(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), collectors.NewGoCollector())
	m.reg.MustRegister(m.requests, m.requestSeconds, m.checkpoints, m.checkpointSeconds, m.restores, m.restoreSeconds,
		live, &episodeStates{s: s, desc: prometheus.NewDesc("stasis_server_episodes", "Episodes in the record store, by state.", []string{"state"}, nil)})
	return m
}

// episodeStates counts the record store's episodes by state at each
// scrape.
type episodeStates struct {
	s    *Server
	desc *prometheus.Desc
}

func (c *episodeStates) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *episodeStates) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rows, err := c.s.store.ListEpisodes(ctx, "")
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.desc, err)
		return
	}
	n := map[store.EpisodeState]int{store.EpisodeRunning: 0, store.EpisodeEnded: 0, store.EpisodeRetired: 0, store.EpisodeLost: 0}
	for _, r := range rows {
		n[r.State]++
	}
	for state, k := range n {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(k), string(state))
	}
}

func (m *metrics) handler(gw prometheus.Gatherer) http.Handler {
	return promhttp.HandlerFor(prometheus.Gatherers{m.reg, gw}, promhttp.HandlerOpts{})
}

// instrument counts and times every request by the route that served it
// (its pattern; "unmatched" for none), and keeps Close waiting for it.
func (s *Server) instrument(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		if !s.enter() {
			writeError(w, http.StatusServiceUnavailable, errUnavailable, "the server is shutting down")
			return
		}
		defer s.leave()
		start := time.Now()
		sw := &serve.StatusRecorder{ResponseWriter: w}
		next.ServeHTTP(sw, q)
		route := q.Pattern // set by the ServeMux on this request
		status := sw.Status()
		switch {
		case route != "":
		case status == http.StatusUnauthorized || status == http.StatusForbidden || status == http.StatusMisdirectedRequest:
			route = "refused" // by the guard, before any route
		default:
			route = "unmatched"
		}
		code := strconv.Itoa(status)
		s.m.requests.WithLabelValues(route, code).Inc()
		s.m.requestSeconds.WithLabelValues(route, code).Observe(time.Since(start).Seconds())
	})
}
