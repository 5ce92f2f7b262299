import { defineConfig } from "vite";

// Built into ../static, which `lightning-grpc serve` serves next to the Connect gateway.
export default defineConfig({
  base: "/",
  build: { outDir: "../static", emptyOutDir: true, sourcemap: true, chunkSizeWarningLimit: 1024 },
});
