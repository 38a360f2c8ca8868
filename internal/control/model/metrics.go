package model

import (
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
)

// metrics are the server's counters, served in the Prometheus text format.
type metrics struct {
	mu               sync.Mutex
	requests         map[[2]string]uint64 // endpoint, code
	faults           map[string]uint64    // kind
	promptTokens     atomic.Uint64
	completionTokens atomic.Uint64
}

func (m *metrics) init() {
	m.requests = map[[2]string]uint64{}
	m.faults = map[string]uint64{}
}

func (m *metrics) request(endpoint, code string) {
	m.mu.Lock()
	m.requests[[2]string{endpoint, code}]++
	m.mu.Unlock()
}

func (m *metrics) fault(kind string) {
	m.mu.Lock()
	m.faults[kind]++
	m.mu.Unlock()
}

func (m *metrics) tokens(prompt, completion int) {
	m.promptTokens.Add(uint64(prompt))
	m.completionTokens.Add(uint64(completion))
}

func (s *Server) serveMetrics(w http.ResponseWriter) {
	m := &s.metrics
	var b strings.Builder
	m.mu.Lock()
	b.WriteString("# HELP stasis_model_requests_total Requests served, by endpoint and HTTP status (\"dropped\": connection cut on purpose).\n")
	b.WriteString("# TYPE stasis_model_requests_total counter\n")
	keys := make([][2]string, 0, len(m.requests))
	for k := range m.requests {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i][0] != keys[j][0] {
			return keys[i][0] < keys[j][0]
		}
		return keys[i][1] < keys[j][1]
	})
	for _, k := range keys {
		fmt.Fprintf(&b, "stasis_model_requests_total{endpoint=%q,code=%q} %d\n", k[0], k[1], m.requests[k])
	}
	b.WriteString("# HELP stasis_model_faults_injected_total Faults injected, by kind (429, 500, drop).\n")
	b.WriteString("# TYPE stasis_model_faults_injected_total counter\n")
	for _, kind := range []string{string(fault429), string(fault500), string(faultDrop)} {
		fmt.Fprintf(&b, "stasis_model_faults_injected_total{kind=%q} %d\n", kind, m.faults[kind])
	}
	m.mu.Unlock()
	b.WriteString("# HELP stasis_model_prompt_tokens_total Prompt tokens of the requests answered.\n")
	b.WriteString("# TYPE stasis_model_prompt_tokens_total counter\n")
	fmt.Fprintf(&b, "stasis_model_prompt_tokens_total %d\n", m.promptTokens.Load())
	b.WriteString("# HELP stasis_model_completion_tokens_total Tokens generated.\n")
	b.WriteString("# TYPE stasis_model_completion_tokens_total counter\n")
	fmt.Fprintf(&b, "stasis_model_completion_tokens_total %d\n", m.completionTokens.Load())
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	_, _ = w.Write([]byte(b.String()))
}
