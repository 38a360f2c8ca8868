package model_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"stasis/internal/control/model"
)

// gatedPost sends a chat request of turn (that many assistant messages
// before it) of the default script and returns the answer's body, or the
// error.
func gatedPost(ctx context.Context, url string, turn int) ([]byte, error) {
	msgs := `{"role":"user","content":"fix it"}`
	for i := range turn {
		msgs += fmt.Sprintf(`,{"role":"assistant","content":"step %d"},{"role":"user","content":"go on"}`, i)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader([]byte(`{"model":"m","messages":[`+msgs+`]}`)))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	return io.ReadAll(resp.Body)
}

// A gate holds the calls until they are let through, by count and by
// which, the oldest first; what it lets through is answered byte for byte
// as without a gate, and counted by script and turn; a call whose client
// goes while it is held is neither answered nor counted; once open, the
// gate holds nothing.
func TestGate(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	g := model.NewGate()
	gated := httptest.NewServer(model.New(model.Options{Seed: 7, Gate: g}))
	defer gated.Close()
	plain := httptest.NewServer(model.New(model.Options{Seed: 7}))
	defer plain.Close()

	type got struct {
		turn int
		body []byte
		err  error
	}
	answers := make(chan got, 4)
	send := func(ctx context.Context, turn int) {
		go func() {
			b, err := gatedPost(ctx, gated.URL, turn)
			answers <- got{turn, b, err}
		}()
	}
	gone, leave := context.WithCancel(ctx)
	for turn := range 3 {
		c := ctx
		if turn == 1 {
			c = gone
		}
		send(c, turn)
		if err := g.Await(ctx, func(w []model.GateCall) bool { return len(w) == turn+1 }); err != nil {
			t.Fatal(err)
		}
	}
	w := g.Waiting()
	for i, c := range w {
		if c.Seq != i+1 || c.Turn != i || c.Script != "default" {
			t.Fatalf("held: %+v", w)
		}
	}
	if len(g.Passed()) != 0 {
		t.Fatalf("a closed gate let calls through: %+v", g.Passed())
	}

	// The client of turn 1 goes: its call leaves the gate, uncounted.
	leave()
	if a := <-answers; a.turn != 1 || a.err == nil {
		t.Fatalf("the call whose client went: %+v", a)
	}
	if err := g.Await(ctx, func(w []model.GateCall) bool { return len(w) == 2 }); err != nil {
		t.Fatal(err)
	}

	// One call of turn 2 through, by which; then the oldest.
	if out := g.Release(5, func(c model.GateCall) bool { return c.Turn == 2 }); len(out) != 1 || out[0].Turn != 2 {
		t.Fatalf("released: %+v", out)
	}
	a := <-answers
	want, err := gatedPost(ctx, plain.URL, 2)
	if err != nil || a.err != nil || a.turn != 2 || !bytes.Equal(a.body, want) {
		t.Fatalf("turn 2 through the gate: %s %v; without it: %s %v", a.body, a.err, want, err)
	}
	if out := g.Release(1, nil); len(out) != 1 || out[0].Turn != 0 {
		t.Fatalf("released: %+v", out)
	}
	if a := <-answers; a.err != nil || a.turn != 0 {
		t.Fatalf("turn 0: %+v", a)
	}
	if p := g.Passed(); len(p) != 2 || p[0].Turn != 2 || p[1].Turn != 0 {
		t.Fatalf("passed: %+v", p)
	}

	// Open: nothing is held, and every call is counted.
	g.Open()
	send(ctx, 4)
	if a := <-answers; a.err != nil || a.turn != 4 {
		t.Fatalf("through the open gate: %+v", a)
	}
	if n := len(g.Passed()); n != 3 || len(g.Waiting()) != 0 {
		t.Fatalf("after the open gate: %d passed, %d held", n, len(g.Waiting()))
	}
	g.Close()
	send(ctx, 0)
	if err := g.Await(ctx, func(w []model.GateCall) bool { return len(w) == 1 }); err != nil {
		t.Fatal(err)
	}
	g.Open()
	if a := <-answers; a.err != nil {
		t.Fatal(a.err)
	}
}
