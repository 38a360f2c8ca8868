package e2b

import (
	"context"
	"time"
)

// reapLoop runs Reap every ReapInterval until Close.
func (p *Provider) reapLoop() {
	defer close(p.done)
	t := time.NewTicker(p.o.ReapInterval)
	defer t.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-p.stop
		cancel()
	}()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
			if _, err := p.Reap(ctx); err != nil && ctx.Err() == nil {
				p.o.Logf("e2b reaper: %v", err)
			}
		}
	}
}

// Reap deletes this provider's sandboxes (of its scope) that are past their
// expiry, running or paused, whether or not the service has ended them,
// and returns their ids. The reaper New starts calls it every ReapInterval.
func (p *Provider) Reap(ctx context.Context) ([]string, error) {
	p.pruneTombstones()
	_, reaped, err := p.list(ctx, nil)
	for _, id := range reaped {
		p.o.Logf("e2b reaper: deleted sandbox %s, past its expiry", id)
	}
	return reaped, err
}

// GC is Reap, under the name the other providers give the removal of
// sandboxes a crash left behind (stasis serve calls it as it starts): here
// those are the sandboxes past their expiry, which no process deleted.
func (p *Provider) GC(ctx context.Context) ([]string, error) { return p.Reap(ctx) }

// tombstoneLife is how long this process remembers that it deleted a
// sandbox at its expiry (calls on it say "expired", not "not found").
const tombstoneLife = time.Hour

func (p *Provider) pruneTombstones() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for id, st := range p.sbs {
		if st.expired && p.now().Sub(st.expiry) > tombstoneLife {
			delete(p.sbs, id)
		}
	}
}

// CollectBlobs is the contract's: E2B keeps the snapshots' data, and a
// snapshot's deletion frees it there; nothing is stored here.
func (p *Provider) CollectBlobs(context.Context) (int, int64, error) { return 0, 0, nil }
